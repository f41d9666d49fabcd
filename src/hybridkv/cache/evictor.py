"""The evictor: frees what the allocator is short of, per component, in policy order.

Window-cached cells go first (``window_cache.py``: window cells of pages that left a running
request's window, worth no hit until that request inserts them): a window need takes them
from its own pool, oldest first; for an allocator's refusal (``for_slabs``) they also serve
every other shortfall, in bytes rounded up to whole slabs (the allocator's broker compacts the
window pool's holes into slabs for the pool short), and while they cover it nothing the tree
holds is touched. Then a full-history need (or ``PAGE_NEED``) evicts whole unlocked leaves
(their pages leave every pool, their checkpoint goes too); a window need tombstones the
window pages of unlocked nodes (a leaf goes whole); a checkpoint need drops unlocked
checkpoints. Candidates come from the residency's lazy heaps, smallest policy key first.

What the allocator is short of is slab bytes as much as cells: a pool may be short while
the other pools' cached cells hold every slab (windows all tombstoned, no checkpoint left
to drop). For an allocator's refusal (``for_slabs``), a pool still short after its own
component's pass therefore evicts whole leaves until they gave back its shortfall in bytes,
rounded up to whole slabs; the allocator's broker hands it the slabs that frees (or
compacts the donor to empty them). Likewise a full-history pool still short once no
unlocked leaf is left gets the bytes of tree window cells outside every window lock (the
nodes a running request locks keep their full KV, not their windows behind its lock's),
and then of unlocked cached checkpoints (a running request short of memory first lets go
of the one its lock holds, ``KVManager``: alone, its own path's checkpoints give way to its
KV, so a request that fits the budget alone fits).

Invariants:
- Nothing locked or pinned by a move gate is evicted; a skipped candidate goes back into
  its heap (a leaf skipped as locked waits parked until an unlock: ``Candidates.park``).
  A window-cached cell is never a running request's needed page: only cells its request
  released from the window are held.
- Memory frees are batched per ``evict`` call and flushed once, in an order that is always
  valid (``Release``). A refused call (unknown or negative need) changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hybridkv.cache.args import integer, mapping
from hybridkv.cache.errors import CacheError
from hybridkv.cache.locks import LockTable
from hybridkv.cache.node import Node
from hybridkv.cache.policies import Policy
from hybridkv.cache.residency import Release, Residency
from hybridkv.cache.rules import PAGE_NEED, PAGE_NEED_SLOT, HitRules, Need, WindowRule
from hybridkv.memory import UnifiedMemory


class Evictor:
    def __init__(self, mem: UnifiedMemory, rules: HitRules, residency: Residency, policy: Policy, locks: LockTable):
        self.mem = mem
        self.locks = locks
        self.rules = rules
        self.residency = residency
        self.policy = policy

    def evict(self, needs: Mapping[Need, int], *, for_slabs: bool = False) -> dict[Need, int]:
        """Free at least ``needs[pool]`` cells per pool where anything unlocked is left.

        Keys: the memory's pool ids or ``PAGE_NEED`` (whole pages, e.g. for a cache-size
        cap). ``for_slabs``: the needs are what an allocation was refused for, so a pool its
        own component cannot serve is served in slab bytes by whole leaves. Returns cells
        freed per pool (and whole pages under ``PAGE_NEED``), only those that freed something.
        """
        rules = self.rules
        asked = mapping(needs, "evict needs")
        unknown = [k for k in asked if k is not PAGE_NEED and k not in rules.pool_ids]
        if unknown:
            raise CacheError(
                f"evict: unknown need {[str(k) for k in unknown]}; name pool ids of this shard "
                f"{sorted(map(str, rules.pool_ids))} or PAGE_NEED ({PAGE_NEED}); a pool name string reads back "
                f"with PoolId.parse"
            )
        given = {k: integer(v, f"evict needs[{k}]", minimum=0) for k, v in asked.items()}
        keys = rules.need_keys
        want = [given.get(k, 0) for k in keys]
        freed = [0] * len(keys)
        release = Release()
        if self.residency.window_cache.total and self._reclaim_window_cached(want, freed, release, for_slabs):
            release.flush(self.mem, self.residency)
            return {k: v for k, v in zip(keys, freed, strict=True) if v}
        full_need = max([want[PAGE_NEED_SLOT], *(want[i] for i in rules.full.slots)])  # no full pool: no slots
        if full_need:
            self._evict_leaves(full_need, freed, release)
        for w in rules.windows:
            need = want[w.slot] - freed[w.slot]
            if need > 0:
                self._evict_windows(w, need, freed, release)
        if rules.checkpoint is not None:
            slot = rules.checkpoint.slot
            need = want[slot] - freed[slot]
            if need > 0:
                self._evict_checkpoints(need, freed, release)
        short = 0
        if for_slabs:
            for r in rules.extra:
                if want[r.slot] > freed[r.slot]:
                    short += (want[r.slot] - freed[r.slot]) * r.cell_bytes
        if short:
            slab = self.mem.arena.slab_bytes
            per_slot = [*zip(rules.full.slots, rules.full.pools_bytes, strict=True)]
            per_slot += [(r.slot, r.cell_bytes) for r in rules.extra]
            self._evict_leaves(-(-short // slab) * slab, freed, release, per_slot)
        if for_slabs and rules.windows:
            self._tombstone_for_bytes(want, freed, release)
        if for_slabs and rules.checkpoint is not None:
            self._drop_checkpoints_for_bytes(want, freed, release)
        release.flush(self.mem, self.residency)
        return {k: v for k, v in zip(keys, freed, strict=True) if v}

    def _tombstone_for_bytes(self, want: list[int], freed: list[int], release: Release) -> None:
        """A full-history pool still short after the leaves (every leaf left is locked): the
        tree's window cells outside every window lock, in bytes rounded up to whole slabs (the
        broker compacts the window pools' holes into slabs for the pool short)."""
        rules = self.rules
        full = zip(rules.full.slots, rules.full.pools_bytes, strict=True)
        short = sum(max(0, want[s] - freed[s]) * b for s, b in full)
        if short <= 0:
            return
        slab = self.mem.arena.slab_bytes
        short = -(-short // slab) * slab
        for w in rules.windows:
            if short <= 0:
                break
            before = freed[w.slot]
            self._evict_windows(w, before + -(-short // w.cell_bytes), freed, release)
            short -= (freed[w.slot] - before) * w.cell_bytes

    def _drop_checkpoints_for_bytes(self, want: list[int], freed: list[int], release: Release) -> None:
        """A page pool still short after the leaves and the windows (every leaf left is locked,
        e.g. by the one running request's own path): unlocked cached checkpoints on locked
        paths, in bytes rounded up to whole slabs (the broker compacts the state pool's holes
        into slabs for the pool short)."""
        rules = self.rules
        rule = rules.checkpoint
        assert rule is not None
        short = sum(
            max(0, want[s] - freed[s]) * b for s, b in zip(rules.full.slots, rules.full.pools_bytes, strict=True)
        )
        short += sum(max(0, want[w.slot] - freed[w.slot]) * w.cell_bytes for w in rules.windows)
        if short <= 0:
            return
        slab = self.mem.arena.slab_bytes
        whole_slabs = -(-short // slab) * slab
        self._evict_checkpoints(freed[rule.slot] + -(-whole_slabs // rule.cell_bytes), freed, release)

    def _reclaim_window_cached(self, want: list[int], freed: list[int], release: Release, for_slabs: bool) -> bool:
        """Reclaim window-cached cells: each window need from its own pool; for an allocator's
        refusal also every other shortfall, in bytes rounded up to whole slabs. Returns whether
        they covered it all (then nothing else is evicted for this call)."""
        rules = self.rules
        for w in rules.windows:
            if want[w.slot]:
                self._take_window_cached(w, want[w.slot], freed, release)
        if not for_slabs:
            return False
        token_bytes = rules.full.page_bytes + sum(w.cell_bytes for w in rules.windows)
        short = want[PAGE_NEED_SLOT] * token_bytes
        short += sum(want[s] * b for s, b in zip(rules.full.slots, rules.full.pools_bytes, strict=True))
        short += sum(max(0, want[r.slot] - freed[r.slot]) * r.cell_bytes for r in rules.extra)
        if short > 0:
            slab = self.mem.arena.slab_bytes
            short = -(-short // slab) * slab
            for w in rules.windows:
                if short > 0:
                    short -= w.cell_bytes * self._take_window_cached(w, -(-short // w.cell_bytes), freed, release)
        return short <= 0

    def _take_window_cached(self, w: WindowRule, need: int, freed: list[int], release: Release) -> int:
        if not self.residency.window_cache.count(w):
            return 0
        taken = self.residency.window_cache.reclaim(w, need, release.window.setdefault(w.pool_id, []))
        freed[w.slot] += taken
        self.residency.counters.reclaimed[w.pool_id] += taken
        return taken

    def _leaf_ok(self, node: Node) -> bool:
        gates = self.mem.gates
        if node.lock or node.checkpoint_lock:
            return False
        if not gates.pinning_gates:  # no pins at all
            return True
        return not np.count_nonzero(gates.page_pins[node.pages]) and (
            node.checkpoint < 0 or not gates.slot_pins[node.checkpoint]
        )

    def _evict_leaves(
        self, need: int, freed: list[int], release: Release, per_slot: list[tuple[int, int]] | None = None
    ) -> None:
        """Evict whole leaves until ``need`` pages are freed or, given ``per_slot`` (need slot,
        cell bytes) pairs, until ``need`` bytes are freed over those pools."""
        heap, skipped, unlocks = self.residency.full_heap, [], self.locks.unlocks
        heap.unpark(unlocks)
        before = list(freed) if per_slot is not None else freed
        while True:
            if per_slot is None:
                if freed[PAGE_NEED_SLOT] >= need:
                    break
            elif sum((freed[s] - before[s]) * b for s, b in per_slot) >= need:
                break
            got = heap.pop()
            if got is None:
                break
            key, node = got
            if node.lock or node.checkpoint_lock:
                heap.park(node, unlocks)  # a running request's: out of every eviction's way until an unlock
                continue
            if not self._leaf_ok(node):
                skipped.append(node)
                continue
            self.policy.evicted(key)
            self.residency.remove_leaf(node, freed, release)
        for node in skipped:
            heap.push(node)

    def _evict_windows(self, w: WindowRule, need: int, freed: list[int], release: Release) -> None:
        heap, gates, skipped = self.residency.window_heaps[w.index], self.mem.gates, []
        while freed[w.slot] < need:
            got = heap.pop()
            if got is None:
                break
            key, node = got
            if not node.children and self._leaf_ok(node):
                self.policy.evicted(key)
                self.residency.remove_leaf(node, freed, release)
                continue
            if node.window_lock or (gates.pinning_gates and np.count_nonzero(gates.page_pins[node.pages])):
                skipped.append(node)
                continue
            self.policy.evicted(key)
            freed[w.slot] += self.residency.tombstone(node, w, release)
        for node in skipped:
            heap.push(node)

    def _evict_checkpoints(self, need: int, freed: list[int], release: Release) -> None:
        rule, heap = self.rules.checkpoint, self.residency.checkpoint_heap
        assert rule is not None and heap is not None
        pins, skipped = self.mem.gates.slot_pins, []
        while freed[rule.slot] < need:
            got = heap.pop()
            if got is None:
                break
            key, node = got
            if node.checkpoint_lock or pins[node.checkpoint]:
                skipped.append(node)
                continue
            self.policy.evicted(key)
            release.slots.append(self.residency.drop_checkpoint(node))
            freed[rule.slot] += 1
            self.residency.counters.evicted_checkpoints += 1
        for node in skipped:
            heap.push(node)
