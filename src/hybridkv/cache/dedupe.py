"""Insert-time dedupe: which of a request's pages duplicate cached ones, and the window
recovery that lets a cached page whose window was evicted take a duplicate's window cells.

Invariants:
- ``duplicates`` refuses (``InsertError``, nothing changed) unless every page that is not
  the cache's own page at its position is in range, live, given once and not cached
  elsewhere; it never changes anything.
- ``adopt_windows`` pairs pages by position in the request's row (first occurrence), never
  by sorting, and moves window residency only (no bytes copied): the duplicate becomes a
  tombstone in that pool, the cached page resident.
"""

from __future__ import annotations

import numpy as np

from hybridkv.cache.errors import InsertError
from hybridkv.cache.radix import Walk
from hybridkv.cache.residency import Residency
from hybridkv.cache.rules import HitRules
from hybridkv.memory import InvalidIds, UnifiedMemory

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False


class Dedupe:
    def __init__(self, mem: UnifiedMemory, rules: HitRules, residency: Residency):
        self.mem = mem
        self.rules = rules
        self.residency = residency

    def duplicates(self, req: np.ndarray, req_bytes: bytes, cached: np.ndarray) -> np.ndarray:
        """Refuse ``req`` (``req_bytes``: its bytes) unless every page that is not the cache's
        own page at its position (a duplicate of a cached page, or a page past the cached
        prefix) is in range, live, given once and not cached elsewhere. Returns the positions
        of the duplicates.

        The cache's own pages at their own positions need no check: they are live and
        distinct (tree invariants), and a repeat of one elsewhere in ``req`` is cached elsewhere.
        """
        fp = cached.size
        dup_idx = _EMPTY
        if fp and not req_bytes.startswith(cached):  # type: ignore[arg-type]  # the request usually passes the cache's own pages
            dup_idx = np.flatnonzero(req[:fp] != cached)
        where = np.concatenate([dup_idx, np.arange(fp, req.size)]) if dup_idx.size else None
        given = req[where] if where is not None else req[fp:]
        if not given.size:
            return dup_idx
        ordered = given if given.size == 1 else np.sort(given)  # the table reads below go in order
        try:
            self.mem.pages.check_live(ordered, "insert", ordered)
        except InvalidIds as exc:
            raise InsertError(f"{exc}; pass pages this request allocated and still holds") from exc
        owned = self.residency.owned[ordered]
        if np.count_nonzero(owned):
            page = int(ordered[np.argmax(owned)])
            j = int(np.flatnonzero(given == page)[0])
            i = int(where[j]) if where is not None else fp + j
            raise InsertError(
                f"insert: page {page} (page {i} of the key) already belongs to the cache at "
                "another position; pass the request's own pages, or the cache's own page there"
            )
        return dup_idx

    def adopt_windows(self, walk: Walk, dup_idx: np.ndarray, dup_pages: np.ndarray) -> int:
        """Locked-full recovery: cached pages whose window was evicted take the request's.

        Pages pair by position in the request's row (first occurrence), never by sorting.
        """
        if not self.rules.windows:
            return 0
        seq = walk.seq
        ends = np.cumsum([n.pages.size for n in seq])
        starts = ends - np.asarray([n.pages.size for n in seq])
        owner = np.searchsorted(ends, dup_idx, side="right")
        kept = walk.pages[dup_idx]
        adopted = 0
        for w in self.rules.windows:
            take = ~w.pool.resident(kept) & w.pool.resident(dup_pages)
            if not np.count_nonzero(take):
                continue
            self.residency.window_cache.drop(dup_pages[take], w)  # a window-cached cell moves to the tree
            self.mem.windows.adopt(dup_pages[take], kept[take], w.pool_id)
            adopted += int(np.count_nonzero(take))
            counts = np.bincount(owner[take], minlength=len(seq))
            for i in np.flatnonzero(counts):
                self.residency.adopted(seq[i], w, dup_idx[take][owner[take] == i] - starts[i])
        return adopted
