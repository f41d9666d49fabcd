"""Virtual id namespaces: the ids everything above ``memory`` holds.

Invariants:
- Ids live in ``[0, capacity)``; id 0 is the sink, always live, never handed out or freed.
- ``live[i]`` is True exactly for the sink and ids handed out and not yet given back; the
  free stack holds every other id exactly once.
- ``take`` hands out the lowest-numbered ids first on a fresh namespace, and refuses (with
  nothing changed) when fewer than asked are free.
- Owner marks: ``held[i]`` marks a live id that one holder (the prefix cache, set by
  ``claim``) keeps; it sets and clears the marks itself. Every free path refuses a marked
  id unless the holder itself frees it (``check_not_held``), so a kept id is never handed
  out again while its holder still serves it. Marks are host-only.
"""

from __future__ import annotations

import numpy as np

from hybridkv.memory.errors import InvalidIds, MemoryPoolError, OutOfMemory
from hybridkv.spec import IdSpace


def distinct(ids: np.ndarray) -> np.ndarray:
    """Sorted distinct values (sort-based; numpy's ``unique`` is several times slower here)."""
    ordered = np.sort(ids)
    if ordered.size < 2:
        return ordered
    keep = np.empty(ordered.size, dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


class VirtualIds:
    def __init__(self, space: IdSpace, capacity: int):
        if capacity < 2:
            raise ValueError(f"{space.value}: a namespace needs room for the sink and one id")
        self.space = space
        self.label = space.value  # for messages only
        self.capacity = capacity
        self.live = np.zeros(capacity, dtype=bool)
        self.live[0] = True
        self._stack = np.arange(capacity - 1, 0, -1, dtype=np.int64)
        self._free = capacity - 1
        self.held = np.zeros(capacity, dtype=bool)
        self.holder: object | None = None
        self._holder_name = ""

    @property
    def free_count(self) -> int:
        return self._free

    @property
    def live_count(self) -> int:
        return self.capacity - 1 - self._free

    def take(self, count: int) -> np.ndarray:
        if count > self._free:
            raise OutOfMemory(
                f"{self.label}: {count} virtual ids asked, {self._free} free of {self.capacity - 1}",
                {self.space: count - self._free},
            )
        ids = self._stack[self._free - count : self._free][::-1].copy()
        self._free -= count
        self.live[ids] = True
        return ids

    def give_back(self, ids: np.ndarray) -> None:
        """Return ids already checked with ``check_live`` (unique, live, not the sink)."""
        self._stack[self._free : self._free + ids.size] = ids[::-1]
        self._free += ids.size
        self.live[ids] = False

    def check_live(self, ids: np.ndarray, what: str, ordered: np.ndarray | None = None) -> None:
        """Raise ``InvalidIds`` unless ``ids`` are distinct, in range, live and not the sink.

        ``ordered``: ``ids`` already sorted, when the caller has them (saves the sort).
        """
        if ids.size == 0:
            return
        if ids.size == 1:  # one id (a state slot, a page): its checks without the array machinery
            only = int(ids[0])
            if 0 < only < self.capacity and self.live[only]:
                return
        if ordered is None:
            ordered = np.sort(ids)  # one sort gives the range and the repeats
        lo, hi = int(ordered[0]), int(ordered[-1])
        if lo <= 0 or hi >= self.capacity:
            first = lo if lo <= 0 else hi
            reason = "the sink id 0" if first == 0 else f"outside 1..{self.capacity - 1}"
            raise InvalidIds(f"{what}: {self.label} id {first} is {reason}")
        live = self.live[ids]
        if np.count_nonzero(live) != ids.size:
            first = int(ids[np.argmax(~live)])
            raise InvalidIds(
                f"{what}: {self.label} id {first} is not allocated (double free, or an id that was never handed out)"
            )
        if ids.size > 1:
            dup = ordered[1:] == ordered[:-1]
            if np.count_nonzero(dup):
                raise InvalidIds(f"{what}: {self.label} id {int(ordered[1:][dup][0])} given twice")

    def claim(self, holder: object, name: str) -> np.ndarray:
        """Make ``holder`` (called ``name`` in errors) the one keeper of ids here; returns the
        ``held`` marks for it to set on ids it keeps and clear before it frees them."""
        held = int(np.count_nonzero(self.held))
        if self.holder is not None and self.holder is not holder and held:
            raise MemoryPoolError(
                f"{self.label} ids already have a holder ({self._holder_name}, keeping {held}); one per memory "
                "(a holder that keeps nothing hands its place over)"
            )
        self.holder, self._holder_name = holder, name
        return self.held

    @property
    def holder_name(self) -> str:
        return self._holder_name or "no holder"

    def check_not_held(self, ids: np.ndarray, what: str, by: object = None) -> None:
        """Raise ``InvalidIds`` if an id is marked held, unless ``by`` is its holder."""
        if self.holder is None or by is self.holder:
            return
        if np.count_nonzero(self.held[ids]):
            first = int(ids[np.argmax(self.held[ids])])
            raise InvalidIds(
                f"{what}: {self.label} {first} is held by {self._holder_name}, which frees it itself "
                "(on eviction); free the request's own ids instead (KVManager.release)"
            )

    def free_ids(self) -> np.ndarray:
        return self._stack[: self._free].copy()
