"""The tree check: recomputes every invariant of ``HybridRadixCache`` from the nodes and the
memory's host tables, instead of trusting the counters it checks. A test tool: it walks the
whole tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hybridkv.cache.node import Node

if TYPE_CHECKING:
    from hybridkv.cache.tree import HybridRadixCache


def _fail(msg: str) -> None:
    raise AssertionError(f"cache check: {msg}")


def check_tree(cache: HybridRadixCache) -> None:
    mem, comps, ps = cache.mem, cache.comps, cache.page_size
    pb = ps * 8
    nodes: list[Node] = []
    for namespace, root in cache._roots.items():
        if root.parent is not None or root.key.size or root.pages.size or root.state >= 0:
            _fail(f"root of namespace {namespace!r} is not an empty root")
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
                count = states_above + (child.state >= 0)
                if count > cache.max_states_per_path:
                    _fail(f"{child}: {count} checkpoints on its path, cap {cache.max_states_per_path}")
                nodes.append(child)
                stack.append((child, count))

    if len(nodes) != cache.num_nodes:
        _fail(f"num_nodes {cache.num_nodes} but {len(nodes)} nodes in the tree")
    pages = np.concatenate([n.pages for n in nodes]) if nodes else np.empty(0, dtype=np.int64)
    if pages.size != np.unique(pages).size:
        _fail("a page id is held by two nodes (or twice by one)")
    owned = np.zeros_like(cache._owned)
    owned[pages] = True
    if not np.array_equal(owned, cache._owned):
        _fail(f"owned-page mask differs from the tree at page {int(np.argmax(owned != cache._owned))}")
    if pages.size != cache.cached_pages:
        _fail(f"cached_pages {cache.cached_pages} but the tree holds {pages.size}")
    if pages.size and not mem.pages.live[pages].all():
        _fail(f"cached page {int(pages[np.argmax(~mem.pages.live[pages])])} is not live in the memory")
    for pool in mem.history_pools:
        if pages.size and not pool.resident(pages).all():
            _fail(f"a cached page is not resident in full-history pool {pool.pool_id}")

    leaves = {n for n in nodes if not n.children}
    if leaves != cache._leaves:
        _fail(f"leaf set differs: {len(leaves)} leaves, tracked {len(cache._leaves)}")
    for w in comps.windows:
        pool = mem.pools[w.pool_id]
        tracked = set()
        for n in nodes:
            count = int(np.count_nonzero(pool.resident(n.pages)))
            if count != n.swa_res[w.index]:
                _fail(f"{n}: {count} pages resident in {w.pool_id}, counted {n.swa_res[w.index]}")
            if count:
                tracked.add(n)
        if tracked != cache._swa_nodes[w.index]:
            _fail(f"{w.pool_id}: set of nodes with resident window pages differs")

    with_state = [n for n in nodes if n.state >= 0]
    if set(with_state) != cache._state_nodes:
        _fail("state-checkpoint node set differs from the nodes holding a slot")
    slots = np.asarray([n.state for n in with_state], dtype=np.int64)
    if slots.size != np.unique(slots).size:
        _fail("a state slot is the checkpoint of two nodes")
    owned_slots = np.zeros_like(cache._owned_slots)
    owned_slots[slots] = True
    if not np.array_equal(owned_slots, cache._owned_slots):
        _fail("owned-slot mask differs from the tree's checkpoints")
    if slots.size and not mem.slots.live[slots].all():
        _fail("a checkpoint slot is not live in the memory")

    heaps = [cache._full, *cache._swa_heaps, cache._state_heap]
    for heap in heaps:
        lowest: dict[int, object] = {}
        for key, uid, _ in heap.heap:
            if uid not in lowest or key < lowest[uid]:  # type: ignore[operator]
                lowest[uid] = key
        waiting = {n.uid for n in heap.pending}
        for n in heap.members:
            if n.uid in waiting:
                continue
            if n.uid not in lowest or lowest[n.uid] > heap.key(n):  # type: ignore[operator]
                _fail(f"{heap.component} candidates: {n} has no entry at or below its current key")
    _check_locks(cache, nodes)


def _check_locks(cache: HybridRadixCache, nodes: list[Node]) -> None:
    full: dict[Node, int] = {}
    swa: dict[Node, int] = {}
    state: dict[Node, int] = {}
    for handle in cache._locks:
        if not handle.active or handle.node.dead:
            _fail(f"open lock on {handle.node} is inactive or its node was evicted")
        for n in handle.node.path():
            full[n] = full.get(n, 0) + 1
        span, n = 0, handle.node
        while span < handle.swa_span:
            if n.parent is None:
                _fail(f"lock on {handle.node}: SWA span {handle.swa_span} reaches above the root")
            swa[n] = swa.get(n, 0) + 1
            span += n.key.size
            n = n.parent
        if span != handle.swa_span:
            _fail(f"lock on {handle.node}: SWA span {handle.swa_span} does not end on a node boundary")
        if handle.state_node is not None:
            if handle.state_node.state < 0:
                _fail(f"lock on {handle.node}: its state checkpoint was dropped while locked")
            state[handle.state_node] = state.get(handle.state_node, 0) + 1
    for n in nodes:
        got = (n.lock, n.swa_lock, n.state_lock)
        want = (full.get(n, 0), swa.get(n, 0), state.get(n, 0))
        if got != want:
            _fail(f"{n}: lock counts (full, swa, state) {got}, open locks say {want}")
