"""RequestAllocator: the one object that allocates memory for requests and frees it.

A request's memory is its virtual token locations (one per context token, in order), its
state slot (models with recurrent layers) and, per sliding-window pool, how many of its
leading pages already left that window. This is where a prefix cache plugs in: a hit at
``admit`` would seed ``locs``/``slot`` from cached nodes instead of fresh allocations, and
``free`` would hand pages to the cache instead of the memory.

Invariants:
- ``locs[:length]`` are live locations; ``extend`` allocates all requests of a step in one
  ``alloc_extend`` call (``alloc_decode`` when every request adds one token to a non-empty
  row) and either succeeds for all or changes nothing (OutOfMemory).
- ``release_windows`` drops from a window pool exactly the pages whose every token lies
  before ``first_needed(length + 1)`` (the pool id's rule: no later query can see them);
  full KV stays.
- ``admit`` takes a waiting request's state slot only when the slot and the pages its first step
  needs both fit; otherwise nothing changes.
- ``free`` returns every page and the state slot; a freed request holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridkv.memory import OutOfMemory, UnifiedMemory
from hybridkv.spec import PoolId

_EMPTY = np.empty(0, dtype=np.int64)


@dataclass
class RequestMemory:
    locs: np.ndarray = field(default_factory=lambda: np.empty(16, dtype=np.int64))
    length: int = 0
    slot: int | None = None
    fresh: bool = True
    window_pages_left: dict[PoolId, int] = field(default_factory=dict)

    @property
    def token_locs(self) -> np.ndarray:
        return self.locs[: self.length]

    def append(self, new: np.ndarray) -> None:
        end = self.length + new.size
        if end > self.locs.size:
            grown = np.empty(max(end, 2 * self.locs.size), dtype=np.int64)
            grown[: self.length] = self.locs[: self.length]
            self.locs = grown
        self.locs[self.length : end] = new
        self.length = end


class RequestAllocator:
    def __init__(self, mem: UnifiedMemory):
        self.mem = mem
        self.windows = [p.pool_id for p in mem.window_pools]
        self.has_state = bool(mem.slot_pools)

    def new(self) -> RequestMemory:
        """A request holding nothing yet (its state slot comes with ``admit``, else its first ``extend``)."""
        return RequestMemory(window_pages_left=dict.fromkeys(self.windows, 0))

    def admit(self, req: RequestMemory, pages: int) -> bool:
        """Whether ``req`` can start now: its state slot (taken here) and ``pages`` more pages fit.

        Free pages alone are not enough: state slots draw on the same slabs and on their own ids.
        """
        if not self.has_state or req.slot is not None:
            return pages <= self.mem.available_pages()
        try:
            slot = self.mem.alloc_state(1)
        except OutOfMemory:
            return False
        if pages > self.mem.available_pages():
            self.mem.free_state(slot)
            return False
        req.slot, req.fresh = int(slot[0]), True
        return True

    def extend(self, reqs: list[RequestMemory], counts: list[int] | np.ndarray) -> None:
        """Grow each request by ``counts[i]`` tokens (prefill chunks and decodes alike)."""
        counts = np.asarray(counts, dtype=np.int64)
        prefix = np.array([r.length for r in reqs], dtype=np.int64)
        last = np.array([r.locs[r.length - 1] if r.length else 0 for r in reqs], dtype=np.int64)
        need_slot = [r for r in reqs if self.has_state and r.slot is None]
        slots = self.mem.alloc_state(len(need_slot)) if need_slot else _EMPTY
        try:
            if prefix.all() and (counts == 1).all():  # decodes only
                new = self.mem.alloc_decode(prefix + 1, last)
            else:
                new = self.mem.alloc_extend(prefix, prefix + counts, last)
        except Exception:
            if slots.size:
                self.mem.free_state(slots)
            raise
        for req, slot in zip(need_slot, slots, strict=True):
            req.slot, req.fresh = int(slot), True
        start = 0
        for req, n in zip(reqs, counts, strict=True):
            req.append(new[start : start + n])
            start += int(n)

    def mark_computed(self, reqs: list[RequestMemory]) -> None:
        """After a forward: states now hold real data, and tokens may have left windows."""
        for req in reqs:
            req.fresh = False
        self.release_windows(reqs)

    def release_windows(self, reqs: list[RequestMemory]) -> None:
        ps = self.mem.page_size
        for pool in self.windows:
            pages = []
            for req in reqs:
                done = req.window_pages_left[pool]
                out = pool.first_needed(req.length + 1) // ps  # pages no later query can see
                if out > done:
                    pages.append(req.locs[done * ps : out * ps : ps] // ps)
                    req.window_pages_left[pool] = out
            if pages:
                self.mem.free_window_pages(np.concatenate(pages), pool)

    def free(self, req: RequestMemory) -> None:
        if req.length:
            self.mem.free_segment(req.token_locs, 0)
        if req.slot is not None:
            self.mem.free_state([req.slot])
        req.length, req.slot, req.fresh = 0, None, True
        req.window_pages_left = dict.fromkeys(self.windows, 0)
