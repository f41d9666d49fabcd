"""The tree check: recomputes every invariant of ``HybridRadixCache`` (tree, residency, locks,
candidates) from the nodes and the memory's host tables, instead of trusting the counters it
checks. A test tool: it walks the whole tree.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hybridkv.cache.locks import LockTable
from hybridkv.cache.node import Node
from hybridkv.cache.radix import RadixTree
from hybridkv.cache.residency import Residency
from hybridkv.cache.rules import HitRules
from hybridkv.memory import UnifiedMemory


class CacheView(Protocol):
    """What the check reads of a ``HybridRadixCache`` (``prefix_cache.py``, which calls it)."""

    mem: UnifiedMemory
    page_size: int
    rules: HitRules
    tree: RadixTree
    residency: Residency
    locks: LockTable
    max_checkpoints_per_path: int

    @property
    def cached_pages(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...


def _fail(msg: str) -> None:
    raise AssertionError(f"cache check: {msg}")


def check_tree(cache: CacheView) -> None:
    mem, rules, ps = cache.mem, cache.rules, cache.page_size
    res = cache.residency
    for n in res.stale:
        if not n.dead and not cache.tree.contains(n):
            _fail(f"{n} waits to be counted (stale) but is not in the tree")
    res.settle()  # the counts below are exact once the dropped checkpoints are counted
    pb = ps * 8
    nodes: list[Node] = []
    for namespace, root in cache.tree.roots.items():
        if root.parent is not None or root.key.size or root.pages.size or root.checkpoint >= 0:
            _fail(f"root of namespace {namespace!r} is not an empty root")
        if not root.children:
            _fail(f"root of namespace {namespace!r} holds no node but is kept")
        stack = [(root, 0)]
        while stack:
            node, states_above = stack.pop()
            for first, child in node.children.items():
                if child.parent is not node or child.dead:
                    _fail(f"{child} under {node}: parent link broken or dead node linked")
                if child.namespace != namespace:
                    _fail(f"{child} has namespace {child.namespace!r} under root {namespace!r}")
                if child.kb[:pb] != first or child.kb != child.key.tobytes():
                    _fail(f"{child}: key bytes disagree with its key or the parent's child key")
                if child.start != node.end or child.key.size == 0:
                    _fail(f"{child}: starts at {child.start}, parent ends at {node.end} (or empty)")
                if child.key.size != child.pages.size * ps:
                    _fail(f"{child}: {child.key.size} tokens but {child.pages.size} pages of {ps}")
                path = child.path_pages
                if path.flags.writeable or not np.array_equal(path, np.concatenate([node.path_pages, child.pages])):
                    _fail(f"{child}: path pages are writable or differ from the pages on its path")
                count = states_above + (child.checkpoint >= 0)
                if count > cache.max_checkpoints_per_path:
                    _fail(f"{child}: {count} checkpoints on its path, cap {cache.max_checkpoints_per_path}")
                nodes.append(child)
                stack.append((child, count))

    for n in reversed(nodes):  # children after their parents in ``nodes``: count bottom-up
        through = [c.checkpoints_below + (c.checkpoint >= 0) for c in n.children.values()]
        if max(through, default=0) != n.checkpoints_below:
            _fail(
                f"{n}: {max(through, default=0)} checkpoints on its deepest path below, counted {n.checkpoints_below}"
            )
        counts = {k: through.count(k) for k in set(through) if k} if len(through) > 1 else None
        if counts != n.below_counts:
            _fail(f"{n}: children add {counts} checkpoints to their paths, counted {n.below_counts}")
    if len(nodes) != cache.num_nodes:
        _fail(f"num_nodes {cache.num_nodes} but {len(nodes)} nodes in the tree")
    pages = np.concatenate([n.pages for n in nodes]) if nodes else np.empty(0, dtype=np.int64)
    if pages.size != np.unique(pages).size:
        _fail("a page id is held by two nodes (or twice by one)")
    owned = np.zeros_like(res.owned)
    owned[pages] = True
    if not np.array_equal(owned, res.owned):
        _fail(f"owned-page mask differs from the tree at page {int(np.argmax(owned != res.owned))}")
    if pages.size != cache.cached_pages:
        _fail(f"cached_pages {cache.cached_pages} but the tree holds {pages.size}")
    if pages.size and not mem.pages.live[pages].all():
        _fail(f"cached page {int(pages[np.argmax(~mem.pages.live[pages])])} is not live in the memory")
    for pool in mem.history_pools:
        if pages.size and not pool.resident(pages).all():
            _fail(f"a cached page is not resident in full-history pool {pool.pool_id}")

    res.window_cache.check(res.owned)

    leaves = {n for n in nodes if not n.children}
    if leaves != cache.tree.leaves:
        _fail(f"leaf set differs: {len(leaves)} leaves, tracked {len(cache.tree.leaves)}")
    for w in rules.windows:
        tracked = set()
        for n in nodes:
            count = w.count(n.pages)
            if count != n.window_resident[w.index]:
                _fail(f"{n}: {count} pages resident in {w.label}, counted {n.window_resident[w.index]}")
            if count:
                tracked.add(n)
        if tracked != res.window_nodes[w.index]:
            _fail(f"{w.label}: set of nodes with resident window pages differs")

    with_checkpoint = [n for n in nodes if n.checkpoint >= 0]
    if set(with_checkpoint) != res.checkpoint_nodes:
        _fail("checkpoint node set differs from the nodes holding a slot")
    slots = np.asarray([n.checkpoint for n in with_checkpoint], dtype=np.int64)
    if slots.size != np.unique(slots).size:
        _fail("a state slot is the checkpoint of two nodes")
    owned_slots = np.zeros_like(res.owned_slots)
    owned_slots[slots] = True
    if not np.array_equal(owned_slots, res.owned_slots):
        _fail("owned-slot mask differs from the tree's checkpoints")
    if slots.size and not mem.slots.live[slots].all():
        _fail("a checkpoint slot is not live in the memory")

    heaps = [res.full_heap, *res.window_heaps, *([res.checkpoint_heap] if res.checkpoint_heap else [])]
    for heap in heaps:
        lowest: dict[int, object] = {}
        for key, uid, _ in heap.heap:
            if uid not in lowest or key < lowest[uid]:  # type: ignore[operator]
                lowest[uid] = key
        waiting = {n.uid for n in heap.pending}
        for n in heap.parked:
            if heap.parked_at == cache.locks.unlocks and not (n.lock or n.checkpoint_lock):
                _fail(f"{heap.component.kind.value} candidates: {n} is parked as locked but no lock holds it")
            waiting.add(n.uid)
        for n in heap.members:
            if n.uid in waiting:
                continue
            if n.uid not in lowest or lowest[n.uid] > heap.key(n):  # type: ignore[operator]
                _fail(f"{heap.component.kind.value} candidates: {n} has no entry at or below its current key")
    want = cache.locks.expected_counts()
    for n in nodes:
        got = (n.lock, n.window_lock, n.checkpoint_lock)
        if got != want.get(n, (0, 0, 0)):
            _fail(f"{n}: lock counts (full, window, checkpoint) {got}, open locks say {want.get(n, (0, 0, 0))}")
