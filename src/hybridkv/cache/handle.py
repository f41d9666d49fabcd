"""KVHandle: everything one request holds in KV memory, in one typed place.

The row is ``pages[0:n]``, one virtual page per ``page_size`` tokens of the sequence. Pages
``[0, cached)`` belong to the cache (held by ``lock``); later pages are the request's own.
``state_slot`` is the request's running recurrent state (None without recurrent layers);
``checkpoints`` maps page-aligned positions to slots holding (or about to hold) the state
after that many tokens, until an insert hands them to the cache. ``gates`` are the move
gates pinning the request's ids while a forward or a transfer reads them.

Invariants:
- ``released[i]``: own pages before this index are released from window pool ``i`` (window-cached:
  the cache holds their cells until memory is needed or the request inserts them), except
  the pages kept for the checkpoint (``keep[i]``: the window before ``match.checkpoint_at``,
  so that a later hit there is valid once the request inserts them).
- A page still in any window of the sequence is never released: the first page window pool
  ``i`` needs is ``windows[i].page_span(seq_len, page_size)[0]`` (the pool id's rule).
- After a (non-final) insert the row's cached part holds the cache's page ids and the lock
  is the new one, taken before the old one is given back: the hit is never unprotected.
- ``status`` only moves forward: (RECEIVING ->) RUNNING -> (COMMITTED ->) RELEASED, or
  RECEIVING -> RELEASED (a transfer that failed). A COMMITTED handle
  has made its final insert (its row's cached part may no longer be locked): it may only
  be released. Every change goes through ``KVManager``; this class holds no memory calls.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from enum import Enum

import numpy as np

from hybridkv.cache.errors import CacheError
from hybridkv.cache.locks import CacheLock
from hybridkv.cache.prefix_cache import MatchResult
from hybridkv.memory import MoveGate
from hybridkv.spec import PoolId

_NO_PAGES = np.empty(0, dtype=np.int64)
_NO_PAGES.flags.writeable = False


def fresh_pages(new_len: int, n_pages: int, page_size: int) -> int:
    """Fresh pages a row of ``n_pages`` needs to hold ``new_len`` tokens (a function, not a method: hot loops over
    many handles call it)."""
    return max(0, -(-new_len // page_size) - n_pages)


class HandleStatus(Enum):
    RECEIVING = "receiving"
    """Holds pages and a state slot its KV and state are being written into (a transfer): nothing
    may read, match, insert or grow it until ``KVManager.received``; ``release`` frees it."""
    RUNNING = "running"
    """Holds its lock, its own pages and slots; may grow, insert, checkpoint."""
    COMMITTED = "committed"
    """Its final insert is done: only ``release`` is left."""
    RELEASED = "released"
    """Holds nothing."""


class KVHandle:
    __slots__ = (
        "_own_row",
        "_row",
        "_state_from_zero",
        "cached",
        "checkpoints",
        "gates",
        "keep",
        "lock",
        "match",
        "n_pages",
        "namespace",
        "page_size",
        "released",
        "seq_len",
        "state_slot",
        "status",
        "windows",
    )

    def __init__(
        self, namespace: Hashable, match: MatchResult, lock: CacheLock, page_size: int, windows: tuple[PoolId, ...]
    ):
        self.namespace = namespace
        self.match = match
        """The hit it was admitted with."""
        self.lock = lock
        self.page_size = page_size
        self.windows = windows
        """Pool id of each window pool (any pool that releases history), in the cache's rule order."""
        self.state_slot: int | None = None
        self._state_from_zero = match.checkpoint is None
        self.checkpoints: dict[int, int] = {}
        self.gates: list[MoveGate] = []
        self.status = HandleStatus.RUNNING
        self._row = match.pages  # the cache's read-only array: copied on the first change
        self._own_row = False
        self.n_pages = self.cached = match.pages.size
        self.seq_len = match.length
        self.released = [self.cached] * len(windows)
        at = match.checkpoint_at
        self.keep = [(0, 0) if at is None else w.page_span(at, page_size) for w in windows]

    def __repr__(self) -> str:
        return (
            f"KVHandle({self.status.value}, {self.seq_len} tokens, {self.n_pages} pages of which "
            f"{self.cached} cached, state slot {self.state_slot}, checkpoints {sorted(self.checkpoints)})"
        )

    @property
    def pages(self) -> np.ndarray:
        return self._row[: self.n_pages]

    @staticmethod
    def rows(handles: Sequence[KVHandle]) -> list[np.ndarray]:
        """Every handle's ``pages`` (a step's requests at once)."""
        return [h._row[: h.n_pages] for h in handles]

    @staticmethod
    def grow_all(handles: Sequence[KVHandle], new_lens: Sequence[int], pages: np.ndarray) -> None:
        """``grow`` each handle to ``new_lens[i]`` tokens with its fresh pages, taken from ``pages`` in order."""
        at = 0
        for h, n in zip(handles, new_lens, strict=True):
            need = fresh_pages(n, h.n_pages, h.page_size)
            _grow(h, n, pages[at : at + need], need)
            at += need
        if at != pages.size:
            raise CacheError(f"extend: {pages.size} fresh pages for requests that need {at}")

    @property
    def state_from_zero(self) -> bool:
        """The running state slot is fresh (the hit had no checkpoint): zero it before the
        first forward. Otherwise it holds a copy of the hit's checkpoint (or, for an adopted
        request, the state that arrived with it)."""
        return self._state_from_zero

    def adopt_state(self, slot: int) -> None:
        """Take ``slot`` (holding this request's state after ``seq_len`` tokens) as the running state."""
        self.state_slot, self._state_from_zero = slot, False

    def token_locs(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Virtual token locations (``page * page_size + offset``) of tokens ``[start, end)``
        (default: the whole sequence), what ``UnifiedMemory.translate`` takes."""
        if self.status is HandleStatus.RECEIVING:
            raise CacheError("token_locs: the request's KV is still arriving; it can be read once received")
        stop = self.seq_len if end is None else end
        if not 0 <= start <= stop <= self.seq_len:
            raise CacheError(f"token_locs: [{start}, {stop}) is not within the request's {self.seq_len} tokens")
        pos = np.arange(start, stop, dtype=np.int64)
        return self._row[pos // self.page_size] * self.page_size + pos % self.page_size

    def own_pages(self) -> np.ndarray:
        return self._row[self.cached : self.n_pages]

    def pages_needed(self, new_len: int) -> int:
        """Fresh pages the row needs to hold ``new_len`` tokens."""
        return fresh_pages(new_len, self.n_pages, self.page_size)

    def check_running(self, what: str) -> None:
        if self.status is not HandleStatus.RUNNING:
            raise CacheError(f"{what}: the request is {self.status.value}; only a running request can do that")

    def grow(self, new_len: int, pages: np.ndarray) -> None:
        """Grow the sequence to ``new_len`` tokens with exactly ``pages_needed`` fresh pages."""
        _grow(self, new_len, pages, self.pages_needed(new_len))

    def window_release(self) -> list[np.ndarray]:
        """Own pages that just left each window pool's window (one array per pool); marks
        them released."""
        out = []
        seq_len, ps, cached, released = self.seq_len, self.page_size, self.cached, self.released
        for i, pool in enumerate(self.windows):
            first_needed = pool.first_needed(seq_len) // ps  # page_span's first page
            lo = released[i] if released[i] > cached else cached
            if first_needed <= lo:
                out.append(_NO_PAGES)
                continue
            idx = np.arange(lo, first_needed)
            k0, k1 = self.keep[i]
            idx = idx[(idx < k0) | (idx >= k1)]
            out.append(self._row[idx])
            self.released[i] = first_needed
        return out

    def _take_cache_pages(self, cache_pages: np.ndarray) -> int:
        n = cache_pages.size
        if not self._own_row:
            self._row, self._own_row = self._row.copy(), True
        self._row[:n] = cache_pages
        self.cached = n
        return n

    def settle(self, cache_pages: np.ndarray, lock: CacheLock) -> CacheLock:
        """After an insert of the first ``len(cache_pages)`` pages: use the cache's ids and
        hold ``lock`` (at the new end) instead of the old one, returned for the caller to
        give back."""
        n = self._take_cache_pages(cache_pages)
        if self.released:
            self.released = [max(r, n) for r in self.released]
        old, self.lock = self.lock, lock
        return old

    def commit(self, cache_pages: np.ndarray) -> None:
        """After the final insert: use the cache's ids; only ``release`` is left."""
        self._take_cache_pages(cache_pages)
        self.status = HandleStatus.COMMITTED


def checked_handle(handle: object, what: str) -> KVHandle:
    """``handle`` as a KVHandle, or a ``CacheError`` naming ``what`` was called with."""
    if not isinstance(handle, KVHandle):
        raise CacheError(f"{what}: expected a KVHandle from KVManager.admit, got {type(handle).__name__}")
    return handle


def checked_handles(handles: object, what: str) -> list[KVHandle]:
    """``handles`` as a list of KVHandles (``checked_handle`` of each)."""
    if isinstance(handles, KVHandle) or not isinstance(handles, Sequence):
        raise CacheError(f"{what}: expected a sequence of KVHandles, got {type(handles).__name__}")
    return [checked_handle(h, what) for h in handles]


def _grow(h: KVHandle, new_len: int, pages: np.ndarray, need: int) -> None:
    """Grow ``h`` to ``new_len`` tokens with ``pages``, the ``need`` fresh pages its caller counted (once)."""
    if new_len < h.seq_len or pages.size != need:
        raise CacheError(f"extend: growing {h.seq_len} -> {new_len} tokens needs {need} fresh pages, got {pages.size}")
    if need == 0:  # most decode steps: the last page has room
        h.seq_len = new_len
        return
    n = h.n_pages
    end = n + need
    if not h._own_row:  # the first growth: the row becomes the request's own array
        h._row, h._own_row = np.concatenate([h._row[:n], pages]), True
    elif end > h._row.size:  # later growth (decode): double the capacity
        row = np.empty(max(end, 2 * h._row.size), dtype=np.int64)
        row[:n] = h._row[:n]
        row[n:end] = pages
        h._row = row
    else:
        h._row[n:end] = pages
    h.n_pages = end
    h.seq_len = new_len
