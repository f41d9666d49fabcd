"""Hit rules: what makes a prefix hit valid at a length ``E``, one class per component kind.

- ``FullKVRule`` (every full-history pool: full / MLA): KV of ``[0, E)`` on the matched path,
  which is what the walk matched, so it never shortens a hit;
- ``WindowRule`` (one per pool that releases history: sliding window, chunked-local, any
  pool id with a bounded ``max_span``): the pages of the span the pool id's rule needs
  before ``E`` (``pool_id.page_span(E, page_size)``; ``[E - W, E)`` for a window ``W``) are
  resident (not tombstoned);
- ``CheckpointRule`` (the recurrent-state pool): a state checkpoint taken exactly after ``E``
  tokens.

Each rule answers ``longest(walk, upto)``: the largest page-aligned ``E <= upto`` valid for
it. ``HitRules.valid_end`` iterates the rules to a fixpoint, which is the largest ``E``
valid for all of them (each step returns the largest valid value at most the current one,
so it never steps over a common one). A new component kind is one more rule class here
and one line in ``HitRules.__init__`` that builds it from the memory's pools; a new pool
family whose rule only bounds the span needs nothing here (its pool id's ``first_needed``
drives ``WindowRule``).

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
from hybridkv.spec import IdSpace, PoolId

if TYPE_CHECKING:
    from hybridkv.cache.node import Node
    from hybridkv.cache.radix import Walk

PAGE_NEED = IdSpace.PAGE
"""An eviction need that is not one pool's cells: whole pages (virtual page ids short, the
key ``OutOfMemory.short`` uses for them, or a cache-size cap); evicts whole leaves."""

Need = PoolId | IdSpace
"""A key of an eviction need: a pool id of the memory, or ``PAGE_NEED``."""

PAGE_NEED_SLOT = 0
"""Index of ``PAGE_NEED`` in ``HitRules.need_keys``."""


class ComponentKind(Enum):
    FULL_KV = "full_kv"
    WINDOW = "window"
    CHECKPOINT = "checkpoint"


class FullKVRule:
    kind = ComponentKind.FULL_KV

    def __init__(self, pools: list[SubPool]):
        self.pools: tuple[PoolId, ...] = tuple(p.pool_id for p in pools)
        self.labels = tuple(str(p) for p in self.pools)
        self.slots = tuple(range(PAGE_NEED_SLOT + 1, PAGE_NEED_SLOT + 1 + len(pools)))
        """Need slot of each pool (``HitRules.need_keys``)."""
        self.pools_bytes = tuple(p.cell_bytes for p in pools)
        """Cell bytes of each pool, in ``pools`` order."""
        self.page_bytes = sum(self.pools_bytes)

    def longest(self, walk: Walk, upto: int) -> int:
        return upto


class WindowRule:
    kind = ComponentKind.WINDOW

    def __init__(self, index: int, pool: SubPool, page_size: int):
        self.index = index
        self.pool = pool
        self.pool_id: PoolId = pool.pool_id
        self.label = str(pool.pool_id)
        """The pool's display name, for events and stats."""
        span = pool.pool_id.max_span
        if span is None:
            raise ValueError(f"pool {self.label} keeps every token; it needs a full-KV rule, not a window rule")
        self.max_span = span
        self.slot = 0
        """Need slot of this pool (``HitRules.need_keys``; set by ``HitRules``)."""
        self.cell_bytes = pool.cell_bytes
        self.page_size = page_size

    def first_page(self, end_pages: int) -> int:
        """First page a hit ending after ``end_pages`` pages needs resident: the first of the
        pool id's ``page_span`` (the end is page-aligned, so the span ends at ``end_pages``)."""
        return self.pool_id.first_needed(end_pages * self.page_size) // self.page_size

    def count(self, pages: np.ndarray) -> int:
        return int(np.count_nonzero(self.pool.resident(pages)))

    def _holds_by_nodes(self, seq: list[Node], end: int) -> bool | None:
        """Whether the window before ``end`` is resident, from per-node counts: None when a
        partly resident node overlaps the window (the pages must tell)."""
        first = self.first_page(end // self.page_size) * self.page_size
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
            # the hit must end before the last tombstone in its span: first_needed is
            # non-decreasing, so every longer end still needs that page
            e = lo + int(gone[-1])
        return e * self.page_size


class CheckpointRule:
    kind = ComponentKind.CHECKPOINT

    def __init__(self, pool: SubPool):
        self.pool = pool
        self.pool_id: PoolId = pool.pool_id
        self.label = str(pool.pool_id)
        self.slot = 0
        """Need slot of this pool (``HitRules.need_keys``; set by ``HitRules``)."""
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
        if len(mem.slot_pools) > 1:
            raise ValueError(
                f"the prefix cache keeps one checkpoint per node, but this memory has "
                f"{len(mem.slot_pools)} slot pools {[str(p.pool_id) for p in mem.slot_pools]}"
            )
        self.checkpoint = CheckpointRule(mem.slot_pools[0]) if mem.slot_pools else None
        self.extra: tuple[WindowRule | CheckpointRule, ...] = (
            *self.windows,
            *((self.checkpoint,) if self.checkpoint is not None else ()),
        )
        self._windows: tuple[Rule, ...] = self.windows
        self._checkpoints: tuple[Rule, ...] = (self.checkpoint,) if self.checkpoint is not None else ()
        self._one_kind = len({r.kind for r in self.extra}) == 1
        self.max_window = max((w.max_span for w in self.windows), default=0)
        """Most tokens any window rule needs before a hit's end (the lock's window span)."""
        self.pool_ids: frozenset[PoolId] = frozenset(mem.pools)
        for i, rule in enumerate(self.extra, start=len(self.full.slots) + 1):
            rule.slot = i
        self.need_keys: tuple[Need, ...] = (PAGE_NEED, *self.full.pools, *(r.pool_id for r in self.extra))
        """Every eviction need, indexed by need slot: eviction counts what it frees in a list
        of this length (no pool-id hashing in its loops)."""

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

    def window_ends(self, walk: Walk, window_len: int) -> tuple[int, ...]:
        """The longest end valid for full KV and each window rule alone (``window_len``, the
        end valid for all of them, when there is one window)."""
        windows = self.windows
        if len(windows) <= 1:
            return (window_len,) * len(windows)
        return tuple(w.longest(walk, walk.full) for w in windows)  # one rule's answer is its own fixpoint


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
