"""The components a prefix hit must cover, read from one ``UnifiedMemory``, and their rules.

- full KV (every full-history pool: ``full`` / ``mla``): valid on the whole matched path;
- each pool that releases history (``swa:<w>``): the pages holding tokens
  ``[first_needed(E), E)`` (the pool id's rule) must be resident (not tombstoned) for a hit
  that ends at ``E``;
- recurrent state (a slot pool): a checkpoint slot exactly at ``E``.

Invariant: a window rule is checked page by page on the host (``resident`` masks from the
memory's host tables), never by reading device memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import PoolId


@dataclass(frozen=True)
class Window:
    index: int
    pool_id: PoolId
    window: int
    """The pool's ``max_span``: the most tokens a hit needs resident here."""
    cell_bytes: int


class Components:
    def __init__(self, mem: UnifiedMemory):
        self.page_size = mem.page_size
        self.history = tuple(p.pool_id for p in mem.history_pools)
        self.windows = tuple(
            Window(i, p.pool_id, int(p.pool_id.max_span or 0), p.cell_bytes) for i, p in enumerate(mem.window_pools)
        )
        self.state = mem.slot_pools[0].pool_id if mem.slot_pools else None
        self.history_page_bytes = sum(p.cell_bytes for p in mem.history_pools)
        self.state_bytes = sum(p.cell_bytes for p in mem.slot_pools)
        self.max_window = max((w.window for w in self.windows), default=0)
        self.pool_ids = frozenset(mem.pools)

    @property
    def full_only(self) -> bool:
        return not self.windows and self.state is None

    def window_first_page(self, w: Window, end_pages: int) -> int:
        """First page a hit ending after ``end_pages`` pages needs in window pool ``w``."""
        return w.pool_id.first_needed(end_pages * self.page_size) // self.page_size

    def window_ok(self, resident: list[np.ndarray], end_pages: int) -> bool:
        """Every window pool holds the pages of its window before ``end_pages`` pages."""
        for w, res in zip(self.windows, resident, strict=True):
            lo = self.window_first_page(w, end_pages)
            if np.count_nonzero(res[lo:end_pages]) != end_pages - lo:
                return False
        return True

    def longest_window_end(self, resident: list[np.ndarray], end_pages: int) -> int:
        """Largest ``e <= end_pages`` (in pages) whose window is resident in every pool."""
        e = end_pages
        changed = True
        while e > 0 and changed:
            changed = False
            for w, res in zip(self.windows, resident, strict=True):
                lo = self.window_first_page(w, e)
                if np.count_nonzero(res[lo:e]) == e - lo:
                    continue
                gone = np.flatnonzero(~res[lo:e])
                if gone.size:
                    e = lo + int(gone[-1])  # the hit must end before the last tombstone
                    changed = True
                    if e == 0:
                        break
        return e
