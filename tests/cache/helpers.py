"""Shared helpers for cache tests: small memories, tree snapshots, tree contents as keys."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from hybridkv.cache import HybridRadixCache, Node
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import ShardSpec, get_preset
from tests.cache.oracle import Oracle

BUDGETS = {
    "tiny-dense": 100_000,
    "tiny-swa": 150_000,
    "tiny-gdn": 150_000,
    "tiny-swa2-state": 200_000,
    "tiny-kda-mla": 60_000,
}
FLOORS = {"tiny-gdn": 78_336, "tiny-swa2-state": 126_208, "tiny-kda-mla": 39_168}
"""The least budget ``small_memory`` (page size 4) accepts: one 64-token request fits
(``test_stateful.test_floors_are_the_floors`` proves it)."""


def small_memory(preset: str, page_size: int = 4, budget: int | None = None, device: str = "cpu") -> UnifiedMemory:
    return UnifiedMemory.create(
        ShardSpec.whole(get_preset(preset)),
        budget or BUDGETS[preset],
        device,
        page_size=page_size,
        max_context=64,
        chunk_tokens=16,
    )


def oracle_for(cache: HybridRadixCache) -> Oracle:
    rules = cache.rules
    state = rules.checkpoint.label if rules.checkpoint is not None else None
    return Oracle(cache.page_size, {w.label: w.max_span for w in rules.windows}, rules.full.labels, state)


def nodes_of(cache: HybridRadixCache) -> list[tuple[Hashable, tuple[int, ...], Node]]:
    """Every node with its namespace and the tokens from the root to its end."""
    out = []
    for ns, root in cache.tree.roots.items():
        stack: list[tuple[Node, tuple[int, ...]]] = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                tokens = prefix + tuple(int(t) for t in child.key)
                out.append((ns, tokens, child))
                stack.append((child, tokens))
    return out


def assert_oracle_matches_tree(cache: HybridRadixCache, oracle: Oracle) -> None:
    """The event-fed oracle holds exactly the tree's pages, window residency and states."""
    ps = cache.page_size
    full: set = set()
    window: dict[str, set] = {w.label: set() for w in cache.rules.windows}
    states: set = set()
    for ns, tokens, node in nodes_of(cache):
        for i in range(node.pages.size):
            key = (ns, tokens[: node.start + (i + 1) * ps])
            full.add(key)
            for w in cache.rules.windows:
                if cache.mem.pools[w.pool_id].resident(node.pages[i : i + 1])[0]:
                    window[w.label].add(key)
        if node.checkpoint >= 0:
            states.add((ns, tokens))
    assert full == oracle.full, "events disagree with the tree's full-KV pages"
    for name in window:
        assert window[name] == oracle.window[name], f"events disagree with the tree's {name} residency"
    assert states == oracle.states, "events disagree with the tree's state checkpoints"


def tree_snapshot(cache: HybridRadixCache) -> list[object]:
    """Everything a refused call must leave as it was."""
    rows = [
        (
            ns,
            tokens,
            tuple(node.pages.tolist()),
            node.checkpoint,
            node.lock,
            node.window_lock,
            node.checkpoint_lock,
            tuple(node.window_resident),
            node.last_access,
            node.hits,
        )
        for ns, tokens, node in nodes_of(cache)
    ]
    return [
        sorted(rows, key=repr),
        cache.residency.owned.copy().tolist(),
        cache.residency.owned_slots.copy().tolist(),
        cache.cached_pages,
        cache.num_nodes,
        len(cache.locks.open),
        cache.stats(),
    ]


def same_pages(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))
