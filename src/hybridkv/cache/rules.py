"""Hit rules: what makes a prefix hit valid at a length ``E``, one class per component kind.

- ``FullKVRule`` (every full-history pool: full / MLA): KV of ``[0, E)`` on the matched path,
  which is what the walk matched, so it never shortens a hit;
- ``WindowRule`` (one per sliding-window pool of window ``W``): the pages holding tokens
  ``[E - W, E)`` are resident (not tombstoned);
- ``CheckpointRule`` (the recurrent-state pool): a state checkpoint taken exactly after ``E``
  tokens.

Each rule answers ``longest(walk, upto)``: the largest page-aligned ``E <= upto`` valid for
it. ``HitRules.valid_end`` iterates the rules to a fixpoint, which is the largest ``E``
valid for all of them (each step returns the largest valid value at most the current one,
so it never steps over a common one). A new component kind is one more rule class here
and one line in ``HitRules.__init__`` that builds it from the memory's pools.

Invariant: rules read the memory's host tables (``resident`` masks) and per-node counts,
never device memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from hybridkv.memory import UnifiedMemory
from hybridkv.memory.pool import SubPool

if TYPE_CHECKING:
    from hybridkv.cache.node import Node
    from hybridkv.cache.radix import Walk

PoolName = str
"""A pool id of the memory, used as an opaque value (``pool.name`` / a key of ``mem.pools``)."""


class ComponentKind(Enum):
    FULL_KV = "full_kv"
    WINDOW = "window"
    CHECKPOINT = "checkpoint"


class FullKVRule:
    kind = ComponentKind.FULL_KV

    def __init__(self, pools: list[SubPool]):
        self.pools: tuple[PoolName, ...] = tuple(p.name for p in pools)
        self.page_bytes = sum(p.cell_bytes for p in pools)

    def longest(self, walk: Walk, upto: int) -> int:
        return upto


class WindowRule:
    kind = ComponentKind.WINDOW

    def __init__(self, index: int, pool: SubPool, page_size: int):
        self.index = index
        self.pool = pool
        self.name: PoolName = pool.name
        self.window = int(pool.layout.window or 0)
        self.cell_bytes = pool.cell_bytes
        self.page_size = page_size

    def first_page(self, end_pages: int) -> int:
        """First page a hit ending after ``end_pages`` pages needs resident."""
        return max(0, end_pages * self.page_size - self.window) // self.page_size

    def count(self, pages: np.ndarray) -> int:
        return int(np.count_nonzero(self.pool.resident(pages)))

    def _holds_by_nodes(self, seq: list[Node], end: int) -> bool | None:
        """Whether the window before ``end`` is resident, from per-node counts: None when a
        partly resident node overlaps the window (the pages must tell)."""
        first = max(0, end - self.window) // self.page_size * self.page_size
        i = self.index
        for n in reversed(seq):
            if n.start >= end:
                continue
            if n.end <= first:
                break
            resident = n.window_resident[i]
            if resident == n.pages.size:
                continue
            return False if resident == 0 else None
        return True

    def longest(self, walk: Walk, upto: int) -> int:
        if self._holds_by_nodes(walk.seq, upto):
            return upto
        known = walk.resident
        if known is None:
            known = walk.resident = {}
        res = known.get(self.index)
        if res is None:
            res = known[self.index] = self.pool.resident(walk.pages)
        e = upto // self.page_size
        while e > 0:
            lo = self.first_page(e)
            gone = np.flatnonzero(~res[lo:e])
            if not gone.size:
                break
            e = lo + int(gone[-1])  # the hit must end before the last tombstone in its window
        return e * self.page_size


class CheckpointRule:
    kind = ComponentKind.CHECKPOINT

    def __init__(self, pool: SubPool):
        self.pool = pool
        self.name: PoolName = pool.name
        self.cell_bytes = pool.cell_bytes

    def longest(self, walk: Walk, upto: int) -> int:
        for n in reversed(walk.nodes):
            if n.end <= upto and n.checkpoint >= 0:
                return n.end
        return 0


Rule = FullKVRule | WindowRule | CheckpointRule


class HitRules:
    """The rules of one memory's components."""

    def __init__(self, mem: UnifiedMemory):
        self.page_size = ps = mem.page_size
        self.full = FullKVRule(mem.history_pools)
        self.windows = tuple(WindowRule(i, p, ps) for i, p in enumerate(mem.window_pools))
        self.checkpoint = CheckpointRule(mem.state_pool) if mem.state_pool is not None else None
        self.extra: tuple[WindowRule | CheckpointRule, ...] = (
            *self.windows,
            *((self.checkpoint,) if self.checkpoint is not None else ()),
        )
        self._windows: tuple[Rule, ...] = self.windows
        self._checkpoints: tuple[Rule, ...] = (self.checkpoint,) if self.checkpoint is not None else ()
        self._one_kind = len({r.kind for r in self.extra}) == 1
        self.max_window = max((w.window for w in self.windows), default=0)
        self.pool_names: frozenset[PoolName] = frozenset(mem.pools)

    @property
    def full_only(self) -> bool:
        return not self.extra

    def valid_end(self, walk: Walk) -> tuple[int, int, int]:
        """The hit's end valid for every rule; the longest valid for full KV and the window
        rules alone; the longest valid for full KV and the checkpoint rule alone."""
        full = walk.full
        windows, checkpoints = self._windows, self._checkpoints
        window_len = _fixpoint(windows, walk, full) if windows else full
        checkpoint_len = _fixpoint(checkpoints, walk, full) if checkpoints else full
        end = min(window_len, checkpoint_len)
        if not self._one_kind:
            end = _fixpoint(self.extra, walk, end)
        return end, window_len, checkpoint_len


def _fixpoint(rules: Sequence[Rule], walk: Walk, end: int) -> int:
    if len(rules) == 1:
        return rules[0].longest(walk, end)  # one rule's answer is its own fixpoint
    changed = True
    while changed and end > 0:
        changed = False
        for rule in rules:
            e = rule.longest(walk, end)
            if e != end:
                end, changed = e, True
    return end
