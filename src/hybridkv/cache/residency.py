"""What the tree holds, per component: cached pages, window residency, checkpoints.

The one place that changes what the cache owns: a new leaf's pages, a leaf removed whole,
a node's window pages tombstoned or adopted, a checkpoint attached or dropped. Each change
updates, together, the ownership masks, the per-node window counts and member sets, the
eviction candidates (``candidates.py``), the counters and the events.

Invariants (``check_tree`` proves them):
- ``owned`` marks exactly the page ids held by a node, ``owned_slots`` exactly the
  checkpoint slots; ``cached_pages`` counts the first. Both are the memory's own owner
  marks (``VirtualIds.claim``): the memory refuses every free of a marked id but ours, so
  a mark is cleared before the id is freed, and a cached id is never freed by a caller. Every cached page is live and
  resident in every full-history pool; a tombstoned window page stays in the tree.
- ``window_cache`` holds the window cells of pages that left a running request's window
  (not the tree's yet): see ``window_cache.py``.
- ``window_nodes[i]`` is the set of nodes with a page resident in window pool ``i``
  (``node.window_resident[i] > 0``); ``checkpoint_nodes`` the nodes with a checkpoint.
- ``node.checkpoints_below`` (every non-root node) is the most checkpoints on a path strictly
  below it, and ``node.below_counts`` (nodes with two children or more) how many children
  add each positive count: updated up the path when a checkpoint comes or goes (each level
  stops as soon as its value does not change; a one-child level is a plain copy; a batch of
  changes along one path, the cap's attach, is counted once at its end: ``recount_path``; a
  checkpoint dropped or a leaf removed is counted lazily, ``stale`` until ``settle``, which
  runs before anything reads a count), built when
  a node gains its second child, dropped when it is down to one, and copied into the upper
  half of a split, so the cap per path (``checkpoints.py``) never walks a subtree.
- Memory frees are never done here: ``Release`` collects them, and whoever evicts flushes
  it once (window pages, then pages, then slots: an order that is always valid).
- A ``ResidencyHook`` (storage tiers below the device) hears every component the tree
  stores, after the change, and every component it evicts, *before* the change, while the
  bytes are still live; with a hook (or events) every node carries its chained page names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from itertools import pairwise
from typing import Protocol

import numpy as np

from hybridkv.cache.candidates import Candidates
from hybridkv.cache.events import CacheEvent, EventKind, EventLog, chain_hashes
from hybridkv.cache.node import NO_CHECKPOINT, Node
from hybridkv.cache.policies import Policy
from hybridkv.cache.radix import RadixTree
from hybridkv.cache.rules import PAGE_NEED, PAGE_NEED_SLOT, ComponentKind, HitRules, WindowRule
from hybridkv.cache.window_cache import WindowCache
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import PoolId

__all__ = ["PAGE_NEED", "CacheCounters", "Release", "Residency", "ResidencyHook"]


class ResidencyHook(Protocol):
    """What a storage tier below the device hears from the tree. ``pool`` is None for full KV
    (every full-history pool), a window pool's id, or the state pool's id for a checkpoint."""

    def stored(self, node: Node, kind: ComponentKind, pool: PoolId | None) -> None:
        """``node``'s component ``kind`` is cached now (a new leaf's pages and windows, or a
        checkpoint attached at its end)."""

    def evicting(self, node: Node, kind: ComponentKind, pool: PoolId | None) -> None:
        """``node``'s component is about to be evicted: its pages (every full page, or the
        window cells still resident in ``pool``) or its checkpoint slot are still live and
        unchanged; they are freed once the eviction flushes."""


@dataclass
class Release:
    """Memory frees batched over one eviction: window pages first, then pages, then slots."""

    window: dict[PoolId, list[np.ndarray]] = field(default_factory=dict)
    pages: list[np.ndarray] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    def flush(self, mem: UnifiedMemory, holder: object) -> None:
        """Free everything collected; ``holder`` drops the windows of pages it still keeps."""
        for pool, parts in self.window.items():
            if parts:
                mem.windows.free(np.concatenate(parts), pool, by=holder)
        if self.pages:
            mem.free_pages(np.concatenate(self.pages))
        if self.slots:
            mem.free_state(np.asarray(self.slots, dtype=np.int64))


@dataclass
class CacheCounters:
    matches: int = 0
    inserts: int = 0
    duplicate_pages: int = 0
    adopted_pages: int = 0
    evicted_pages: int = 0
    """Full KV pages freed by eviction (whole leaves)."""
    tombstoned: dict[PoolId, int] = field(default_factory=dict)
    """Window pages freed by window eviction, per window pool (full KV kept)."""
    reclaimed: dict[PoolId, int] = field(default_factory=dict)
    """Window-cached cells (of running requests' pages) freed by eviction, per window pool."""
    evicted_checkpoints: int = 0
    capped_checkpoints: int = 0
    given_up_checkpoints: int = 0
    """A running request's own checkpoints (not inserted yet) freed so that its pages fit."""


class Residency:
    def __init__(self, mem: UnifiedMemory, tree: RadixTree, rules: HitRules, policy: Policy, events: EventLog):
        self.mem = mem
        self.tree = tree
        self.rules = rules
        self.events = events
        self.hook: ResidencyHook | None = None
        """Storage tiers' hook (``HybridRadixCache.set_residency_hook``)."""
        self.counters = CacheCounters(
            tombstoned={w.pool_id: 0 for w in rules.windows}, reclaimed={w.pool_id: 0 for w in rules.windows}
        )
        self.owned = mem.pages.claim(self, "the prefix cache")
        self.window_cache = WindowCache(mem, rules.windows, self)
        self.owned_slots = mem.slots.claim(self, "the prefix cache")
        self.cached_pages = 0
        self.window_nodes: list[set[Node]] = [set() for _ in rules.windows]
        self.checkpoint_nodes: set[Node] = set()
        self.stale: dict[Node, int] = {}
        """Nodes whose count of checkpoints through them dropped (a checkpoint dropped, a leaf
        removed: dead) since their parent counted them, with the count it holds (``settle``)."""
        key = policy.key
        self.full_heap = Candidates(rules.full, key, tree.leaves)
        self.window_heaps = [Candidates(w, key, s) for w, s in zip(rules.windows, self.window_nodes, strict=True)]
        self.checkpoint_heap = (
            Candidates(rules.checkpoint, key, self.checkpoint_nodes) if rules.checkpoint is not None else None
        )

    def refresh(self, node: Node) -> None:
        """Give every candidate heap ``node`` belongs to an entry with its current key (call
        whenever a key may have dropped; hits only raise keys)."""
        if node in self.tree.leaves:
            self.full_heap.push(node)
        for i, res in enumerate(node.window_resident):
            if res:
                self.window_heaps[i].push(node)
        if node.checkpoint >= 0:
            assert self.checkpoint_heap is not None
            self.checkpoint_heap.push(node)

    # --- pages ----------------------------------------------------------------------------

    def add_leaf(self, node: Node) -> None:
        """A leaf the tree just added: its pages are the cache's now."""
        parent = node.parent
        if parent is not None and parent.parent is not None and len(parent.children) == 2:
            self.settle()
            other = next(c for c in parent.children.values() if c is not node)  # the leaf adds 0
            through = other.checkpoints_below + (other.checkpoint >= 0)
            parent.below_counts = {through: 1} if through else {}
        pages = node.pages
        self.owned[pages] = True
        self.cached_pages += pages.size
        for w in self.rules.windows:
            count = node.window_resident[w.index] = w.count(pages)
            if count:
                self.window_nodes[w.index].add(node)
        if self.names_pages:
            parent = node.parent
            assert parent is not None and parent.hashes is not None
            node.hashes = chain_hashes(parent.hashes[-1], node.key, self.tree.page_size)
        if self.events.enabled:
            every = np.arange(pages.size)
            for label in self.rules.full.labels:
                self.emit(EventKind.STORED, label, ComponentKind.FULL_KV, node, every, with_tokens=True)
            for w in self.rules.windows:
                self.emit(EventKind.STORED, w.label, w.kind, node, np.flatnonzero(w.pool.resident(pages)))
        self.refresh(node)
        if self.hook is not None:
            self.hook.stored(node, ComponentKind.FULL_KV, None)
            for w in self.rules.windows:
                if node.window_resident[w.index]:
                    self.hook.stored(node, w.kind, w.pool_id)

    def remove_leaf(self, node: Node, freed: list[int], release: Release) -> None:
        """Evict a whole leaf: its pages leave every pool, its checkpoint goes too. ``freed``
        is indexed by need slot (``HitRules.need_keys``)."""
        if self.hook is not None:
            for w in self.rules.windows:
                if node.window_resident[w.index]:
                    self.hook.evicting(node, w.kind, w.pool_id)
            self.hook.evicting(node, ComponentKind.FULL_KV, None)
        if self.events.enabled:
            for w in self.rules.windows:
                if node.window_resident[w.index]:  # not tombstoned earlier in this eviction
                    local = np.flatnonzero(w.pool.resident(node.pages))
                    self.emit(EventKind.REMOVED, w.label, w.kind, node, local)
        if node.checkpoint >= 0:
            assert self.rules.checkpoint is not None
            freed[self.rules.checkpoint.slot] += 1
            release.slots.append(self._take_checkpoint(node))
        if self.events.enabled:
            for label in self.rules.full.labels:
                self.emit(EventKind.REMOVED, label, ComponentKind.FULL_KV, node, np.arange(node.pages.size))
        parent = node.parent
        new_leaf = self.tree.remove_leaf(node)
        if new_leaf is not None:
            self.refresh(new_leaf)
        if parent is not None and len(parent.children) < 2:  # the leaf added nothing to its paths
            parent.below_counts = None
        n = node.pages.size
        for slot in self.rules.full.slots:
            freed[slot] += n
        freed[PAGE_NEED_SLOT] += n
        for w in self.rules.windows:
            freed[w.slot] += node.window_resident[w.index]
            self.window_nodes[w.index].discard(node)
        release.pages.append(node.pages)
        self.owned[node.pages] = False
        self.cached_pages -= n
        self.counters.evicted_pages += n

    def tombstone(self, node: Node, w: WindowRule, release: Release) -> int:
        """Evict a node's window pages in pool ``w`` (its full KV stays); returns how many."""
        count = node.window_resident[w.index]
        if self.hook is not None:
            self.hook.evicting(node, w.kind, w.pool_id)
        whole = count == node.pages.size  # every page resident: no table read needed
        gone = node.pages if whole else node.pages[w.pool.resident(node.pages)]
        release.window.setdefault(w.pool_id, []).append(gone)
        self.counters.tombstoned[w.pool_id] += count
        if self.events.enabled:
            local = np.arange(count) if whole else np.flatnonzero(w.pool.resident(node.pages))
            self.emit(EventKind.REMOVED, w.label, w.kind, node, local)
        node.window_resident[w.index] = 0
        self.window_nodes[w.index].discard(node)
        self.refresh(node)
        return count

    def adopted(self, node: Node, w: WindowRule, local: np.ndarray) -> None:
        """Pages ``local`` of ``node`` became resident in ``w`` again (window adoption)."""
        node.window_resident[w.index] += int(local.size)
        self.window_nodes[w.index].add(node)
        self.refresh(node)
        if self.events.enabled:
            self.emit(EventKind.STORED, w.label, w.kind, node, local)

    def split(self, upper: Node, lower: Node) -> None:
        """Divide window counts and event names between the halves of a split node; the upper
        half sees every path below through the lower one."""
        upper.checkpoints_below = lower.checkpoints_below + (lower.checkpoint >= 0)  # its one child's
        if lower in self.stale:  # the parent counts the upper half now, with the lower one's old count
            self.stale[upper] = self.stale.pop(lower)
        if lower.hashes is not None:
            kp = upper.pages.size
            upper.hashes, lower.hashes = lower.hashes[:kp], lower.hashes[kp:]
        for w in self.rules.windows:
            up = w.count(upper.pages)
            upper.window_resident[w.index] = up
            lower.window_resident[w.index] -= up
            if up:
                self.window_nodes[w.index].add(upper)
            if not lower.window_resident[w.index]:
                self.window_nodes[w.index].discard(lower)
        self.refresh(upper)
        self.refresh(lower)

    # --- checkpoints ----------------------------------------------------------------------

    def attach_checkpoint(self, node: Node, slot: int, *, count: bool = True) -> None:
        """Cache ``slot`` as ``node``'s checkpoint. ``count=False``: the ancestors' path counts
        are left for ``recount_path`` (a batch along one path, ``CheckpointCap.attach``)."""
        node.checkpoint = slot
        if count:
            self.settle()
            _count_up(node, node.checkpoints_below, node.checkpoints_below + 1)
        self.owned_slots[slot] = True
        self.checkpoint_nodes.add(node)
        self.refresh(node)
        if self.events.enabled:
            self.emit_checkpoint(EventKind.STORED, node)
        if self.hook is not None:
            self.hook.stored(node, ComponentKind.CHECKPOINT, self.mem.slot_pools[0].pool_id)

    def drop_checkpoint(self, node: Node, *, count: bool = True) -> int:
        """Take the checkpoint off ``node``; returns its slot (the caller frees it).
        ``count=False``: as for ``attach_checkpoint``."""
        slot = self._take_checkpoint(node, count)
        self.refresh(node)
        return slot

    def path_contributions(self, path: list[Node]) -> dict[Node, int]:
        """Before a batch of uncounted changes on ``path`` (root side first): what each branching
        node's path child adds to the paths through it, for ``recount_path``."""
        return {n: c.checkpoints_below + (c.checkpoint >= 0) for n, c in pairwise(path) if n.below_counts is not None}

    def recount_path(self, last: Node, before: dict[Node, int]) -> None:
        """Bring the counts of ``last``'s ancestors up to date after uncounted checkpoint changes
        on its path only (nothing below ``last`` changed; ``before`` from
        ``path_contributions`` of the path before the changes). One walk up the path."""
        through = last.checkpoints_below + (last.checkpoint >= 0)
        parent = last.parent
        while parent is not None and parent.parent is not None:
            counts = parent.below_counts
            if counts is None:  # one child: its count is the parent's
                new = through
            else:
                _recount(counts, before[parent], through)
                new = max(counts, default=0)
            parent.checkpoints_below = new
            through = new + (parent.checkpoint >= 0)
            parent = parent.parent

    def _take_checkpoint(self, node: Node, count: bool = True) -> int:
        if self.hook is not None:
            self.hook.evicting(node, ComponentKind.CHECKPOINT, self.mem.slot_pools[0].pool_id)
        if self.events.enabled:
            self.emit_checkpoint(EventKind.REMOVED, node)
        slot = node.checkpoint
        self.owned_slots[slot] = False
        self.checkpoint_nodes.discard(node)
        node.checkpoint = NO_CHECKPOINT
        if count:  # counted lazily: evictions drop many, nothing reads the counts until ``settle``
            self.stale.setdefault(node, node.checkpoints_below + 1)
        return slot

    def settle(self) -> None:
        """Bring the counts up to date after checkpoints dropped and leaves removed (``stale``):
        deepest first, each parent once per stale child, stopping where a count does not change.
        Called before anything reads a count (an attach, a node gaining its second child, the
        check), so evicting a path of n checkpoints bottom-up costs O(n), not O(n^2)."""
        stale = self.stale
        if not stale:
            return
        order = [(-n.start, n.uid, n) for n in stale]
        heapify(order)
        while order:
            node = heappop(order)[2]
            old = stale.pop(node)
            new = 0 if node.dead else node.checkpoints_below + (node.checkpoint >= 0)
            parent = node.parent
            if old == new or parent is None or parent.parent is None:
                continue
            counts = parent.below_counts
            if counts is None:  # one child (or none left; or a second one, being added): count them
                count = max((c.checkpoints_below + (c.checkpoint >= 0) for c in parent.children.values()), default=0)
            else:
                _recount(counts, old, new)
                count = max(counts, default=0)
            if count != parent.checkpoints_below:
                if parent not in stale:  # its own parent counts it with its value until now
                    stale[parent] = parent.checkpoints_below + (parent.checkpoint >= 0)
                    heappush(order, (-parent.start, parent.uid, parent))
                parent.checkpoints_below = count

    # --- events ---------------------------------------------------------------------------

    @property
    def names_pages(self) -> bool:
        """Nodes carry chained page names (``Node.hashes``): for events, or for a hook."""
        return self.events.enabled or self.hook is not None

    def emit(
        self,
        kind: EventKind,
        component: str,
        component_kind: ComponentKind,
        node: Node,
        local: np.ndarray,
        with_tokens: bool = False,
    ) -> None:
        if not local.size:
            return
        assert node.hashes is not None and node.parent is not None and node.parent.hashes is not None
        hashes = tuple(node.hashes[int(i)] for i in local)
        parent_hash = tokens = None
        if with_tokens:
            parent_hash = node.parent.hashes[-1]
            tokens = tuple(int(t) for t in node.key)
        self.events.emit(CacheEvent(kind, component, component_kind, node.namespace, hashes, parent_hash, tokens))

    def emit_checkpoint(self, kind: EventKind, node: Node) -> None:
        assert node.hashes is not None and self.rules.checkpoint is not None
        self.events.emit(
            CacheEvent(kind, self.rules.checkpoint.label, ComponentKind.CHECKPOINT, node.namespace, (node.hashes[-1],))
        )


def _count_up(node: Node, before: int, after: int) -> None:
    """``node`` now adds ``after`` checkpoints to the paths through it (``before`` until now):
    bring ``below_counts`` and ``checkpoints_below`` of its ancestors up to date, stopping at
    the first whose maximum does not change. A level costs O(1), or the number of distinct
    counts below it (at most the cap per path) when its maximum drops."""
    parent = node.parent
    while parent is not None and parent.parent is not None and before != after:
        counts = parent.below_counts
        old = parent.checkpoints_below
        if counts is None:  # one child: its count is the parent's
            new = after
        else:
            _recount(counts, before, after)
            new = after if after > old else old if old in counts else max(counts, default=0)
        if new == old:
            return
        parent.checkpoints_below = new
        has = parent.checkpoint >= 0
        before, after = old + has, new + has
        parent = parent.parent


def _recount(counts: dict[int, int], old: int, new: int) -> None:
    """One child's contribution to ``counts`` (a multiset of the children's nonzero path counts)
    moves from ``old`` to ``new``."""
    if old == new:
        return
    if old:
        if counts[old] == 1:
            del counts[old]
        else:
            counts[old] -= 1
    if new:
        counts[new] = counts.get(new, 0) + 1
