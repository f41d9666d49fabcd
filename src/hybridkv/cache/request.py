"""RequestKV: one running request's row of pages on top of the cache, and its SWA window.

The row is ``pages[0:n]``, one virtual page per ``page_size`` tokens of the sequence.
Pages ``[0, cached)`` belong to the cache (held by ``lock``); later pages are the request's
own. As the sequence grows, the request's own pages that left a window pool's window
(tokens before ``seq_len - window``) are released from that pool (``window_release``) —
the rest of the engine batches the frees; the tree keeps tombstones for them once
inserted.

Invariants:
- ``released[i]``: own pages before this index are released from window pool ``i``, except
  the pages kept for the checkpoint (``keep[i]``: the window before ``match.checkpoint_at``,
  so that a later hit there is valid once the request inserts them).
- A page still in any window of the sequence is never released: the first page a window
  needs is ``max(0, seq_len - window) // page_size``.
- ``settle`` swaps the row's cached part for the cache's page ids after an insert and
  takes the new lock before giving back the old one, so the hit is never unprotected.
"""

from __future__ import annotations

import numpy as np

from hybridkv.cache.errors import CacheError
from hybridkv.cache.tree import CacheLock, HybridRadixCache, InsertResult, MatchResult


class RequestKV:
    def __init__(self, cache: HybridRadixCache, match: MatchResult):
        self.cache = cache
        self.page_size = ps = cache.page_size
        self.match = match
        self.lock: CacheLock = cache.lock(match.node)
        self._row = np.empty(max(16, match.pages.size * 2), dtype=np.int64)
        self._row[: match.pages.size] = match.pages
        self.n_pages = match.pages.size
        self.cached = match.pages.size
        self.seq_len = match.length
        windows = cache.comps.windows
        self.released = [self.cached] * len(windows)
        self.keep: list[tuple[int, int]] = []
        for w in windows:
            if match.checkpoint_at is None:
                self.keep.append((0, 0))
            else:
                at = match.checkpoint_at
                self.keep.append((w.pool_id.first_needed(at) // ps, at // ps))

    @property
    def pages(self) -> np.ndarray:
        return self._row[: self.n_pages]

    def own_pages(self) -> np.ndarray:
        return self._row[self.cached : self.n_pages]

    def pages_needed(self, new_len: int) -> int:
        """Fresh pages the row needs to hold ``new_len`` tokens."""
        return max(0, -(-new_len // self.page_size) - self.n_pages)

    def extend(self, new_len: int, pages: np.ndarray) -> None:
        """Grow the sequence to ``new_len`` tokens with exactly ``pages_needed`` fresh pages."""
        need = self.pages_needed(new_len)
        if new_len < self.seq_len or pages.size != need:
            raise CacheError(
                f"extend: growing {self.seq_len} -> {new_len} tokens needs {need} fresh pages, got {pages.size}"
            )
        end = self.n_pages + need
        if end > self._row.size:
            row = np.empty(max(end, 2 * self._row.size), dtype=np.int64)
            row[: self.n_pages] = self.pages
            self._row = row
        self._row[self.n_pages : end] = pages
        self.n_pages = end
        self.seq_len = new_len

    def window_release(self) -> list[np.ndarray]:
        """Own pages that just left each window pool's window (one array per pool)."""
        out = []
        for i, w in enumerate(self.cache.comps.windows):
            first_needed = w.pool_id.first_needed(self.seq_len) // self.page_size
            lo = max(self.released[i], self.cached)
            if first_needed <= lo:
                out.append(self._row[:0])
                continue
            idx = np.arange(lo, first_needed)
            k0, k1 = self.keep[i]
            idx = idx[(idx < k0) | (idx >= k1)]
            out.append(self._row[idx])
            self.released[i] = first_needed
        return out

    def settle(self, result: InsertResult) -> None:
        """After inserting the first ``len(result.pages)`` pages: use the cache's ids, relock."""
        n = result.pages.size
        if n > self.n_pages or n < self.cached:
            raise CacheError(
                f"settle: the insert covered {n} pages, but the row has {self.n_pages} pages of "
                f"which {self.cached} were cached already"
            )
        lock = self.cache.lock(result.node)
        self.cache.unlock(self.lock)
        self.lock = lock
        self._row[:n] = result.pages
        self.cached = n
        self.released = [max(r, n) for r in self.released]

    def unlock(self) -> None:
        self.cache.unlock(self.lock)
