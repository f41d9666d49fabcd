"""The components a prefix hit must cover, read from one ``UnifiedMemory``, and their rules.

- full KV (every full-history pool: ``full`` / ``mla``): valid on the whole matched path;
- each sliding-window pool ``swa:<w>``: the pages holding tokens ``[E - w, E)`` must be
  resident (not tombstoned) for a hit that ends at ``E``;
- recurrent state: a checkpoint slot exactly at ``E``.

Invariant: a window rule is checked page by page on the host (``resident`` masks from the
memory's host tables), never by reading device memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridkv.memory import UnifiedMemory


@dataclass(frozen=True)
class Window:
    index: int
    name: str
    window: int
    cell_bytes: int


class Components:
    def __init__(self, mem: UnifiedMemory):
        self.page_size = mem.page_size
        self.history = tuple(p.name for p in mem.history_pools)
        self.windows = tuple(
            Window(i, p.name, int(p.layout.window or 0), p.cell_bytes) for i, p in enumerate(mem.window_pools)
        )
        self.state = mem.state_pool.name if mem.state_pool is not None else None
        self.history_page_bytes = sum(p.cell_bytes for p in mem.history_pools)
        self.state_bytes = mem.state_pool.cell_bytes if mem.state_pool is not None else 0
        self.max_window = max((w.window for w in self.windows), default=0)
        self.pool_names = frozenset(mem.pools)

    @property
    def full_only(self) -> bool:
        return not self.windows and self.state is None

    def window_first_page(self, window: int, end_pages: int) -> int:
        """First page a hit ending after ``end_pages`` pages needs in a window pool."""
        return max(0, end_pages * self.page_size - window) // self.page_size

    def window_ok(self, resident: list[np.ndarray], end_pages: int) -> bool:
        """Every window pool holds the pages of its window before ``end_pages`` pages."""
        for w, res in zip(self.windows, resident, strict=True):
            lo = self.window_first_page(w.window, end_pages)
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
                lo = self.window_first_page(w.window, e)
                if np.count_nonzero(res[lo:e]) == e - lo:
                    continue
                gone = np.flatnonzero(~res[lo:e])
                if gone.size:
                    e = lo + int(gone[-1])  # the hit must end before the last tombstone
                    changed = True
                    if e == 0:
                        break
        return e
