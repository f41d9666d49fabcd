"""Window-cached pages: window cells that left a running request's window, kept until memory is needed.

A request's page that slides out of a window pool's window is not freed there: the cache holds
its window cell (the memory's owner mark, ``mem.windows.hold``). The page is
still the request's own (its full KV is live for it); when the request inserts it, the page
joins the tree node that covers it, window cell resident, so a later hit ending inside that
span is valid (``WindowRule``). Until then the cell is worth nothing to a hit, so eviction
reclaims these cells first, oldest first, before anything the tree holds.

Invariants (``check_tree`` proves them with ``check``):
- A page is window-cached in pool ``i`` exactly when the memory marks it held there; such a
  page is live, resident there, and not the tree's (``drop`` runs when the request inserts
  or releases it, before the tree owns it or the memory frees it).
- Every window-cached page has an entry in its pool's queue. Entries of pages dropped since
  stay until popped or until the queue is rebuilt (when stale entries outnumber the members
  by more than ``slack``), so memory and reclaim work stay proportional to the members.
- A reclaim drops a page's mark when it takes the page (a page id queued twice, once per
  time it was held, is taken once) and hands its window cell to a ``Release``; a page pinned
  by a move gate is skipped and keeps its entry.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from hybridkv.cache.rules import WindowRule
from hybridkv.memory import UnifiedMemory

_EMPTY = np.empty(0, dtype=np.int64)


class WindowCache:
    def __init__(self, mem: UnifiedMemory, windows: tuple[WindowRule, ...], holder: object, slack: int = 4096):
        self.mem = mem
        self.windows = windows
        self.holder = holder
        self.queues: list[deque[np.ndarray]] = [deque() for _ in windows]
        self.queued = [0] * len(windows)
        """Entries in each queue, stale ones included."""
        self._slack = slack

    def count(self, w: WindowRule) -> int:
        return self.mem.windows.held_count(w.pool_id)

    @property
    def total(self) -> int:
        return sum(self.mem.windows.held_count(w.pool_id) for w in self.windows)

    def hold(self, pages: np.ndarray, w: WindowRule) -> None:
        """Keep the window cells of ``pages`` (a request's own pages that left ``w``'s window)."""
        if not pages.size:
            return
        self.mem.windows.hold(pages, w.pool_id, by=self.holder)
        self.queues[w.index].append(pages.copy())
        self.queued[w.index] += pages.size
        if self.queued[w.index] > 2 * self.count(w) + self._slack:
            self._rebuild(w)

    def drop(self, pages: np.ndarray, only: WindowRule | None = None) -> None:
        """``pages`` are no longer a request's own window-cached pages (the tree took them, or
        they are about to be freed): drop the marks of those held, in every window pool (or in
        ``only``)."""
        if not pages.size:
            return
        for w in self.windows if only is None else (only,):
            if self.mem.windows.held_count(w.pool_id):
                self.mem.windows.drop_holds(pages, w.pool_id, by=self.holder)

    def reclaim(self, w: WindowRule, need: int, out: list[np.ndarray]) -> int:
        """Take up to ``need`` window-cached cells of ``w``, oldest first, into ``out`` (the
        caller frees them in ``w``'s pool); returns how many."""
        queue, marks = self.queues[w.index], self.mem.windows.held(w.pool_id)
        pins, pinning = self.mem.gates.page_pins, self.mem.gates.pinning_gates
        taken = 0
        skipped: list[np.ndarray] = []
        while taken < need and queue:
            entry = queue.popleft()
            self.queued[w.index] -= entry.size
            live = entry[marks[entry]]
            if pinning and live.size:
                pinned = pins[live] > 0
                if np.count_nonzero(pinned):
                    skipped.append(live[pinned])
                    live = live[~pinned]
            if live.size > need - taken:
                queue.appendleft(live[need - taken :])
                self.queued[w.index] += live.size - (need - taken)
                live = live[: need - taken]
            if live.size:
                self.mem.windows.drop_holds(live, w.pool_id, by=self.holder)
                out.append(live)
                taken += live.size
        for entry in reversed(skipped):
            queue.appendleft(entry)
            self.queued[w.index] += entry.size
        return taken

    def _rebuild(self, w: WindowRule) -> None:
        """Drop stale entries (and the older entry of a page id held twice), keeping order."""
        queue = self.queues[w.index]
        pages = np.concatenate(queue) if queue else _EMPTY
        pages = pages[self.mem.windows.held(w.pool_id)[pages]]
        _, last = np.unique(pages[::-1], return_index=True)
        kept = pages[np.sort(pages.size - 1 - last)]
        queue.clear()
        if kept.size:
            queue.append(kept)
        self.queued[w.index] = kept.size

    def check(self, owned: np.ndarray) -> None:
        """Raise ``AssertionError`` unless the invariants above hold (a test tool)."""
        for w, queue in zip(self.windows, self.queues, strict=True):
            held = np.flatnonzero(self.mem.windows.held(w.pool_id))
            if held.size != self.count(w):
                raise AssertionError(f"window cache {w.label}: {held.size} marks, counted {self.count(w)}")
            if owned[held].any():
                page = int(held[np.argmax(owned[held])])
                raise AssertionError(f"window cache {w.label}: page {page} is window-cached and in the tree")
            queued = np.concatenate(queue) if queue else _EMPTY
            if queued.size != self.queued[w.index]:
                raise AssertionError(f"window cache {w.label}: {queued.size} entries, counted {self.queued[w.index]}")
            missing = np.setdiff1d(held, queued)
            if missing.size:
                raise AssertionError(f"window cache {w.label}: page {int(missing[0])} is held but not queued")
