"""Events a router follows: stored / removed per component, named by chained page hashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED, CacheError, ComponentKind, EventKind, HybridRadixCache
from hybridkv.cache.events import chain_hashes, root_hash
from hybridkv.spec import WindowPool
from tests.cache.helpers import assert_oracle_matches_tree, oracle_for, small_memory

PS = 4


def kinds(events) -> list[tuple[str, str, int]]:
    """(kind, the component's display name, pages) per event."""
    return [(e.kind.value, str(e.component), len(e.block_hashes)) for e in events]


def window_pool(cache: HybridRadixCache, window: int):
    return WindowPool(window)


def test_event_sequence_of_insert_tombstone_and_eviction():
    cache = HybridRadixCache(small_memory("tiny-swa2-state", PS), events=True)
    router = oracle_for(cache)
    toks = np.arange(24)
    row = cache.mem.alloc_pages(6)
    cache.mem.windows.free(row[:2], window_pool(cache, 8))
    cache.insert(toks, row, checkpoints={24: int(cache.mem.alloc_state(1)[0])})
    events = cache.events.drain()
    assert kinds(events) == [
        ("stored", "full", 6),
        ("stored", "swa:8", 4),
        ("stored", "swa:24", 6),
        ("stored", "state", 1),
    ]
    assert [e.component_kind for e in events] == [
        ComponentKind.FULL_KV,
        ComponentKind.WINDOW,
        ComponentKind.WINDOW,
        ComponentKind.CHECKPOINT,
    ]
    full = events[0]
    assert full.parent_hash == root_hash(None) and full.tokens == tuple(range(24))
    assert list(full.block_hashes) == chain_hashes(root_hash(None), toks, PS)
    router.apply(events)
    assert_oracle_matches_tree(cache, router)

    # a branch splits the node: nothing is renamed, only the new pages are announced
    shared = cache.match_prefix(toks).pages[:1]
    fresh = cache.mem.alloc_pages(1)
    result = cache.insert(np.concatenate([toks[:4], [90, 91, 92, 93]]), np.concatenate([shared, fresh]))
    events = cache.events.drain()
    assert kinds(events) == [("stored", "full", 1), ("stored", "swa:8", 1), ("stored", "swa:24", 1)]
    assert result.prefix_len == 4
    router.apply(events)
    assert_oracle_matches_tree(cache, router)

    assert cache.rules.checkpoint is not None
    cache.evict({PAGE_NEED: 100, cache.rules.checkpoint.pool_id: 1})
    events = cache.events.drain()
    assert {e.kind for e in events} == {EventKind.REMOVED}
    router.apply(events)
    assert_oracle_matches_tree(cache, router)
    assert not router.full and not router.states


def test_events_are_off_by_default():
    cache = HybridRadixCache(small_memory("tiny-dense", PS))
    cache.insert(np.arange(8), cache.mem.alloc_pages(2))
    assert len(cache.events) == 0 and cache.events.drain() == []


_NAMES = """
import json, sys
import numpy as np
from hybridkv.cache import HybridRadixCache
from tests.cache.helpers import small_memory

cache = HybridRadixCache(small_memory("tiny-dense", 4), events=True)
for namespace in (None, "tenant-a", ("salt", 7)):
    cache.insert(np.arange(12), cache.mem.alloc_pages(3), extra_key=namespace)
print(json.dumps([[e.parent_hash, list(e.block_hashes)] for e in cache.events.drain()]))
"""


def test_event_names_agree_across_processes_with_different_hash_seeds():
    """A router in another process must name the same pages the same way: Python's
    ``hash()`` of bytes and str is salted per process (PYTHONHASHSEED)."""
    root = Path(__file__).resolve().parents[2]
    names = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
        out = subprocess.run([sys.executable, "-c", _NAMES], env=env, capture_output=True, text=True, check=True)
        names.append(json.loads(out.stdout))
    assert len(names[0]) == 3 and all(len(hashes) == 3 for _, hashes in names[0])
    assert names[0] == names[1]
    assert len({parent for parent, _ in names[0]}) == 3, "namespaces must have distinct root names"


def test_a_namespace_without_a_stable_name_is_refused_when_events_are_on():
    cache = HybridRadixCache(small_memory("tiny-dense", PS), events=True)
    with pytest.raises(CacheError, match="no stable name"):
        cache.match_prefix(np.arange(8), frozenset({1}))
    assert not cache.tree.roots
    plain = HybridRadixCache(small_memory("tiny-dense", PS))
    assert plain.match_prefix(np.arange(8), frozenset({1})).length == 0  # events off: any hashable key
