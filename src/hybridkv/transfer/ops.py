"""Transfer ops: what a plan is (``TransferPlan``: ``(src, dst, length)`` sorted by destination),
what was proved about them (``Bounds``), and how elementary pieces become maximal ops
(``coalesce``). Built by ``plan.py``; read by the transports.

Invariants: ops are sorted by destination, their destination ranges never overlap
(``overlap`` is the refusal), and they are maximal: adjacent pieces contiguous on both sides
(on the destination alone for a destination-only plan) are one op. ``Bounds`` come from the
checked cell ids, not from the ops, so reading them costs no pass over the ops.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hybridkv.transfer.errors import PlanError


class Bounds(NamedTuple):
    """What holds for every op: its source lies in ``[src_lo, src_hi)``, its destination in
    ``[dst_lo, dst_hi)``, and it is at least ``min_len`` bytes long."""

    src_lo: int
    src_hi: int
    dst_lo: int
    dst_hi: int
    min_len: int


Ops = np.ndarray | list[int]


def as_ints(ops: Ops) -> list[int]:
    """Op addresses or lengths as a list of Python ints (what per-op loops and engines take)."""
    return ops.tolist() if isinstance(ops, np.ndarray) else ops


class TransferPlan:
    """The ops of one request, sorted by destination, with what was proved about them.

    Ops are held as built: numpy arrays (large plans, built vectorized) or lists of ints
    (small plans, built without numpy, which is what keeps a small request cheap). ``src``,
    ``dst`` and ``length`` give arrays, ``ops`` slices in the held form; each form is made
    from the other at most once.
    """

    def __init__(self, src: Ops, dst: Ops, length: Ops, pieces: int, nbytes: int, bounds: Bounds) -> None:
        self._ops = (src, dst, length)
        self._arrays: tuple[np.ndarray, ...] | None = None
        self.pieces = pieces  # elementary pieces before coalescing
        self.nbytes = nbytes  # sum of the lengths
        self.bounds = bounds  # derived from the checked cell ids, not from the ops
        self.num_ops = len(dst)

    def _as_arrays(self) -> tuple[np.ndarray, ...]:
        if self._arrays is None:
            self._arrays = tuple(np.asarray(x, dtype=np.int64) for x in self._ops)
        return self._arrays

    @property
    def src(self) -> np.ndarray:
        """int64 source addresses (prefill); zeros in a destination-only plan."""
        return self._as_arrays()[0]

    @property
    def dst(self) -> np.ndarray:
        """int64 destination addresses (decode), ascending."""
        return self._as_arrays()[1]

    @property
    def length(self) -> np.ndarray:
        """int64 bytes per op."""
        return self._as_arrays()[2]

    def ops(self, chunk: slice | None = None) -> tuple[Ops, Ops, Ops]:
        """(src, dst, length) of the ops in ``chunk`` (all by default), in the form the plan
        holds; read them, never write them."""
        if chunk is None or (chunk.start in (0, None) and chunk.stop == self.num_ops):
            return self._ops
        src, dst, length = self._ops
        return src[chunk], dst[chunk], length[chunk]

    def chunks(self, max_ops: int, max_bytes: int) -> list[slice]:
        """Consecutive op ranges of at most ``max_ops`` ops and about ``max_bytes`` bytes.

        A single op larger than ``max_bytes`` is a chunk of its own.
        """
        if self.num_ops <= max_ops and self.nbytes <= max_bytes:
            return [slice(0, self.num_ops)] if self.num_ops else []
        ends = np.cumsum(self.length)
        out, i = [], 0
        while i < self.num_ops:
            base = int(ends[i - 1]) if i else 0
            j = int(np.searchsorted(ends, base + max_bytes, side="right"))
            j = min(max(j, i + 1), i + max_ops)
            out.append(slice(i, j))
            i = j
        return out


def overlap(addr: int) -> PlanError:
    return PlanError(
        f"two pieces write the same decode bytes at {addr:#x} (a page or slot given twice in the "
        "request's destination cells?)"
    )


def coalesce(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, merge_src: bool, pieces: int, nbytes: int, bounds: Bounds
) -> TransferPlan:
    """Sort by destination (unless sorted), refuse overlaps, merge contiguous runs.

    Lengths are positive, so non-negative gaps between consecutive pieces mean "sorted and
    disjoint": one reduction decides whether a sort is needed at all, and a smallest gap
    above zero means nothing can merge.
    """
    if dst.size > 1:
        end = dst + length
        gap = dst[1:] - end[:-1]
        smallest = np.minimum.reduce(gap)
        if smallest < 0:  # unsorted, or overlapping
            order = np.argsort(dst, kind="stable")
            src, dst, length = src[order], dst[order], length[order]
            end = dst + length
            gap = dst[1:] - end[:-1]
            smallest = np.minimum.reduce(gap)
            if smallest < 0:
                raise overlap(int(dst[int(np.argmax(gap < 0)) + 1]))
        if smallest == 0:
            joined = gap == 0
            if merge_src:
                joined &= src[:-1] + length[:-1] == src[1:]
            if np.logical_or.reduce(joined):
                starts = np.flatnonzero(np.concatenate(([True], ~joined)))
                src, dst, length = src[starts], dst[starts], np.add.reduceat(length, starts)
    return TransferPlan(src, dst, length, pieces, nbytes, bounds)
