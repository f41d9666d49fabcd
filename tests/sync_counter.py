"""Counts every way host code can read device memory through torch.

Used by the no-host-sync tests: wrap a hot-path call in ``HostSyncCounter`` and assert the
count stays zero. On a CPU machine these reads are cheap, but on a GPU each one blocks the
host until the device catches up, so the count is what matters, not the time.
"""

from __future__ import annotations

from collections import Counter
from numbers import Number
from typing import Any

import torch

_METHODS = (
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


class HostSyncCounter:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        counts = self.counts

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> HostSyncCounter:
        for name in _METHODS:
            self._wrap(torch.Tensor, name)
        for name in ("unique", "nonzero", "unique_consecutive", "argwhere", "masked_select"):
            self._wrap(torch, name)
        original_setitem = torch.Tensor.__setitem__
        counts = self.counts

        def setitem(tensor: torch.Tensor, index: Any, value: Any) -> None:
            if isinstance(value, Number):
                counts["scalar __setitem__"] += 1
            return original_setitem(tensor, index, value)

        self._saved.append((torch.Tensor, "__setitem__", original_setitem))
        torch.Tensor.__setitem__ = setitem  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
