"""Events a router follows: stored / removed per component, named by chained page hashes."""

from __future__ import annotations

import numpy as np

from hybridkv.cache import PAGE_NEED, EventKind, HybridRadixCache
from hybridkv.cache.events import chain_hashes, root_hash
from hybridkv.spec import RECURRENT_POOL, WindowPool
from tests.cache.helpers import assert_oracle_matches_tree, oracle_for, small_memory

PS = 4


def kinds(events) -> list[tuple[str, str, int]]:
    return [(e.kind.value, e.component, len(e.block_hashes)) for e in events]


def test_event_sequence_of_insert_tombstone_and_eviction():
    cache = HybridRadixCache(small_memory("tiny-swa2-state", PS), events=True)
    router = oracle_for(cache)
    toks = np.arange(24)
    row = cache.alloc_pages(6)
    cache.mem.free_window_pages(row[:2], WindowPool(8))
    cache.insert(toks, row, states={24: int(cache.alloc_state(1)[0])})
    events = cache.events.drain()
    assert kinds(events) == [
        ("stored", "full", 6),
        ("stored", "swa:8", 4),
        ("stored", "swa:24", 6),
        ("stored", "state", 1),
    ]
    full = events[0]
    assert full.parent_hash == root_hash(None) and full.tokens == tuple(range(24))
    assert list(full.block_hashes) == chain_hashes(root_hash(None), toks, PS)
    router.apply(events)
    assert_oracle_matches_tree(cache, router)

    # a branch splits the node: nothing is renamed, only the new pages are announced
    shared = cache.match_prefix(toks).pages[:1]
    fresh = cache.alloc_pages(1)
    result = cache.insert(np.concatenate([toks[:4], [90, 91, 92, 93]]), np.concatenate([shared, fresh]))
    events = cache.events.drain()
    assert kinds(events) == [("stored", "full", 1), ("stored", "swa:8", 1), ("stored", "swa:24", 1)]
    assert result.prefix_len == 4
    router.apply(events)
    assert_oracle_matches_tree(cache, router)

    cache.evict({PAGE_NEED: 100, RECURRENT_POOL: 1})
    events = cache.events.drain()
    assert {e.kind for e in events} == {EventKind.REMOVED}
    router.apply(events)
    assert_oracle_matches_tree(cache, router)
    assert not router.full and not router.states


def test_events_are_off_by_default():
    cache = HybridRadixCache(small_memory("tiny-dense", PS))
    cache.insert(np.arange(8), cache.alloc_pages(2))
    assert len(cache.events) == 0 and cache.events.drain() == []
