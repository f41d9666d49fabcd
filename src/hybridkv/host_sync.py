"""Counts every way host code can read device memory through torch.

Used by the no-host-sync tests and the benchmarks: wrap hot-path calls in
``HostSyncCounter`` and assert the count stays zero. On a CPU machine these reads are
cheap, but on a GPU each one blocks the host until the device catches up, so the count is
what matters, not the time. ``counting=False`` pauses counting without unpatching.
``only(tensor)`` counts just the reads of tensors it accepts (e.g. those that alias a memory's
arena: reads of device memory, as opposed to host buffers such as storage-tier frames).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from numbers import Number
from typing import Any

import torch

_TENSOR_METHODS = (
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "unique",
    "cpu",
    "numpy",
)
_TORCH_FUNCTIONS = ("unique", "nonzero", "unique_consecutive", "argwhere", "masked_select")


class HostSyncCounter:
    def __init__(self, only: Callable[[torch.Tensor], bool] | None = None) -> None:
        self.counts: Counter[str] = Counter()
        self.counting = True
        self.only = only
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting and (self.only is None or (args and self._accepts(args[0]))):
                self.counts[name] += 1
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def _accepts(self, value: object) -> bool:
        assert self.only is not None
        return isinstance(value, torch.Tensor) and self.only(value)

    def __enter__(self) -> HostSyncCounter:
        for name in _TENSOR_METHODS:
            self._wrap(torch.Tensor, name)
        for name in _TORCH_FUNCTIONS:
            self._wrap(torch, name)
        original_setitem = torch.Tensor.__setitem__

        def setitem(tensor: torch.Tensor, index: Any, value: Any) -> None:
            if self.counting and isinstance(value, Number) and (self.only is None or self._accepts(tensor)):
                self.counts["scalar __setitem__"] += 1
            return original_setitem(tensor, index, value)

        self._saved.append((torch.Tensor, "__setitem__", original_setitem))
        torch.Tensor.__setitem__ = setitem  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
