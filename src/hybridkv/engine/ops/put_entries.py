"""A step's new K/V (or MLA latent) entries put straight into a token pool's pages and the step's gathered buffer
(``csrc/put_entries.cpp``), in place of ``index_put_`` into the strided ``grid[:, span].movedim(1, 2)`` view (torch's
generic indexing path: ~350 µs a prefill layer, ~40 µs for one decode token) and ``index_copy_`` of a stacked copy.

When (``puts_entries``): CPU tensors of the destination's dtype, the C++ kernels built, ``fast_paths(put_entries=...)``
on. Numerics: a byte copy, bit-equal to the indexed stores it replaces.

Invariants: every index and offset is checked against the destination before any byte is written; the sources are
read in place (one ``(T, *shape)`` tensor per slot, rows of any stride, each entry contiguous).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.native import native


def puts_entries(dst: torch.Tensor, new: Sequence[torch.Tensor]) -> bool:
    """Whether ``put_pages`` / ``put_columns`` into ``dst`` (a grid or a buffer) run the kernel for ``new``."""
    return (
        FAST.put_entries
        and FAST.native_kernels
        and dst.device.type == "cpu"
        and all(x.dtype == dst.dtype and x.device.type == "cpu" and x.dim() >= 2 for x in new)
        and not torch.compiler.is_compiling()
        and native() is not None
    )


def _rows(new: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each slot's entries as ``(T, entry)`` (a view where the entry is contiguous, else a copy)."""
    flat = [x.flatten(1) for x in new]  # a view where the entry's dims allow, else a copy
    return [x if x.stride(1) == 1 else x.contiguous() for x in flat]


def put_pages(
    grid: torch.Tensor, slots: slice, new: Sequence[torch.Tensor], cell: torch.Tensor, offset: torch.Tensor
) -> None:
    """``grid[cell[t], slots.start + s, offset[t]] = new[s][t]`` for every token ``t`` and slot ``s`` (``grid``
    ``(cells, slots, page, *shape)``, ``new`` one ``(T, *shape)`` per slot of ``slots``); ``puts_entries`` must
    hold."""
    kernels = native()
    assert kernels is not None, "puts_entries said the kernels are built"
    if len(new) != slots.stop - slots.start:
        raise ValueError(f"put_pages: {len(new)} new tensors for the {slots.stop - slots.start} slots {slots}")
    kernels.put_entries(grid.flatten(3), slots.start, _rows(new), cell, offset)


def put_columns(buffer: torch.Tensor, slots: slice, new: Sequence[torch.Tensor], cols: torch.Tensor) -> None:
    """``buffer[slots.start + s, cols[t]] = new[s][t]`` (``buffer`` ``(slots, columns, *shape)``, ``new`` one
    ``(T, *shape)`` per slot of ``slots``); ``puts_entries`` must hold."""
    kernels = native()
    assert kernels is not None, "puts_entries said the kernels are built"
    if len(new) != slots.stop - slots.start:
        raise ValueError(f"put_columns: {len(new)} new tensors for the {slots.stop - slots.start} slots {slots}")
    kernels.put_entries(buffer.flatten(2).movedim(1, 0).unsqueeze(2), slots.start, _rows(new), cols, None)
