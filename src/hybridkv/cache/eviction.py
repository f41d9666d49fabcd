"""Eviction driven by what the allocator is short of, per component, in policy order.

A full-history need evicts whole unlocked leaves (their pages leave every pool, their
checkpoint goes too); a window need tombstones the window pages of unlocked inner nodes
(a leaf goes whole); a state need drops unlocked checkpoints. Candidates come from the
tree's lazy heaps (``candidates.py``), smallest policy key first.

Invariants:
- Nothing locked or pinned is evicted; a skipped candidate goes back into its heap.
- Memory frees are batched per eviction and applied in an order that is always valid:
  window pages, then whole pages, then state slots.
- ``alloc_pages`` / ``alloc_state`` / ``fork_state`` retry after each eviction and give up
  with the allocator's ``OutOfMemory`` once nothing more can be freed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from hybridkv.cache.errors import CacheError
from hybridkv.cache.events import EventKind
from hybridkv.cache.node import Node
from hybridkv.memory import OutOfMemory, UnifiedMemory
from hybridkv.spec import RECURRENT_POOL, IdSpace, PoolId

if TYPE_CHECKING:
    from hybridkv.cache.tree import HybridRadixCache

PAGE_NEED = IdSpace.PAGE
"""``evict`` key for "free whole pages" (virtual page ids short, or a cache-size cap)."""

Need = PoolId | IdSpace
"""An ``evict`` key: a pool of this shard, or ``PAGE_NEED``."""

T = TypeVar("T")


@dataclass
class Release:
    """Memory frees batched over one eviction: window pages first, then pages, then slots."""

    window: dict[PoolId, list[np.ndarray]] = field(default_factory=dict)
    pages: list[np.ndarray] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    def flush(self, mem: UnifiedMemory) -> None:
        for pool, parts in self.window.items():
            if parts:
                mem.free_window_pages(np.concatenate(parts), pool)
        if self.pages:
            mem.free_pages(np.concatenate(self.pages))
        if self.slots:
            mem.free_state(np.asarray(self.slots, dtype=np.int64))


class Eviction:
    """The eviction half of ``HybridRadixCache`` (mixed into it; uses its tree state)."""

    def evict(self: HybridRadixCache, needs: Mapping[Need, int]) -> dict[Need, int]:
        """Free at least ``needs[pool]`` cells per pool where anything unlocked is left.

        Keys: pool ids of this shard (``FULL_POOL``, ``WindowPool(w)``, ``RECURRENT_POOL``...)
        or ``PAGE_NEED`` (whole pages, e.g. for a cache-size cap). Full-history needs evict whole leaves (freeing
        their pages in every pool); window needs tombstone SWA residency of inner nodes
        (a leaf goes whole); state needs drop checkpoints. Returns cells freed per pool
        (and ``"page"``).
        """
        comps = self.comps
        unknown = [str(k) for k in needs if k is not PAGE_NEED and k not in comps.pool_ids]
        if unknown:
            pools = [str(p) for p in sorted(comps.pool_ids, key=PoolId.sort_key)]
            raise CacheError(
                f"evict: unknown need {unknown}; name pool ids of this shard {pools} or PAGE_NEED "
                "(a pool name string reads back with PoolId.parse)"
            )
        bad = {str(k): v for k, v in needs.items() if int(v) < 0}
        if bad:
            raise CacheError(f"evict: needs must be >= 0, got {bad}")
        freed: dict[Need, int] = dict.fromkeys((*comps.pool_ids, PAGE_NEED), 0)
        release = Release()
        full_keys: tuple[Need, ...] = (*comps.history, PAGE_NEED)
        full_need = max([int(needs.get(n, 0)) for n in full_keys])
        if full_need:
            self._evict_leaves(full_need, freed, release)
        for w in comps.windows:
            need = int(needs.get(w.pool_id, 0)) - freed[w.pool_id]
            if need > 0:
                self._evict_windows(w.index, need, freed, release)
        if comps.state is not None:
            need = int(needs.get(comps.state, 0)) - freed[comps.state]
            if need > 0:
                self._evict_states(need, freed, release)
        release.flush(self.mem)
        return {k: v for k, v in freed.items() if v}

    def _leaf_ok(self: HybridRadixCache, node: Node) -> bool:
        gates = self.mem.gates
        if node.lock or node.state_lock:
            return False
        if not gates.pinning_gates:  # no pins at all
            return True
        return not np.count_nonzero(gates.page_pins[node.pages]) and (node.state < 0 or not gates.slot_pins[node.state])

    def _evict_leaves(self: HybridRadixCache, need: int, freed: dict[Need, int], release: Release) -> None:
        skipped = []
        while freed[PAGE_NEED] < need:
            got = self._full.pop()
            if got is None:
                break
            key, node = got
            if not self._leaf_ok(node):
                skipped.append(node)
                continue
            self.policy.evicted(key)
            self._remove_leaf(node, freed, release)
        for node in skipped:
            self._full.push(node)

    def _evict_windows(self: HybridRadixCache, index: int, need: int, freed: dict[Need, int], release: Release) -> None:
        w = self.comps.windows[index]
        heap, gates = self._swa_heaps[index], self.mem.gates
        pool = self.mem.pools[w.pool_id]
        parts = release.window.setdefault(w.pool_id, [])
        skipped = []
        while freed[w.pool_id] < need:
            got = heap.pop()
            if got is None:
                break
            key, node = got
            if not node.children and self._leaf_ok(node):
                self.policy.evicted(key)
                self._remove_leaf(node, freed, release)
                continue
            if node.swa_lock or (gates.pinning_gates and np.count_nonzero(gates.page_pins[node.pages])):
                skipped.append(node)
                continue
            self.policy.evicted(key)
            count = node.swa_res[index]
            whole = count == node.pages.size  # every page resident: no table read needed
            parts.append(node.pages if whole else node.pages[pool.resident(node.pages)])
            freed[w.pool_id] += count
            self.counters.tombstoned[w.pool_id] += count
            node.swa_res[index] = 0
            self._swa_nodes[index].discard(node)
            self._refresh(node)
            if self.events.enabled:
                local = np.arange(count) if whole else np.flatnonzero(pool.resident(node.pages))
                self._emit(EventKind.REMOVED, w.pool_id, node, local)
        for node in skipped:
            heap.push(node)

    def _evict_states(self: HybridRadixCache, need: int, freed: dict[Need, int], release: Release) -> None:
        state = self.comps.state
        assert state is not None
        pins = self.mem.gates.slot_pins
        skipped = []
        while freed[state] < need:
            got = self._state_heap.pop()
            if got is None:
                break
            key, node = got
            if node.state_lock or pins[node.state]:
                skipped.append(node)
                continue
            self.policy.evicted(key)
            release.slots.append(node.state)
            self._drop_state(node)
            freed[state] += 1
            self.counters.evicted_states += 1
        for node in skipped:
            self._state_heap.push(node)

    # --- allocation through the cache -----------------------------------------------------

    def alloc_pages(self: HybridRadixCache, count: int) -> np.ndarray:
        """``mem.alloc_pages``, evicting what the allocator is short of until it fits."""
        return self._with_eviction(lambda: self.mem.alloc_pages(count), {PAGE_NEED: count})

    def alloc_state(self: HybridRadixCache, count: int) -> np.ndarray:
        state = self.comps.state or RECURRENT_POOL
        return self._with_eviction(lambda: self.mem.alloc_state(count), {state: count})

    def fork_state(self: HybridRadixCache, slots: object) -> np.ndarray:
        state = self.comps.state or RECURRENT_POOL
        n = int(np.asarray(slots).size)
        return self._with_eviction(lambda: self.mem.fork_state(slots), {state: n})  # type: ignore[arg-type]

    def _with_eviction(self: HybridRadixCache, call: Callable[[], T], fallback: dict[Need, int]) -> T:
        while True:
            try:
                return call()
            except OutOfMemory as exc:
                # virtual-id shortages are keyed by id space (or come without ``short``):
                # they need whole pages / checkpoints back
                short: dict[Need, int] = {
                    (self.comps.state or RECURRENT_POOL) if k is IdSpace.SLOT else k: v
                    for k, v in (exc.short or fallback).items()
                }
                if not any(self.evict(short).values()):
                    raise
