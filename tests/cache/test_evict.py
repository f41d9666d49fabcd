"""Eviction: driven by what the allocator is short of, never touching locked entries, in the
order each policy defines."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED, POLICIES, CacheError, HybridRadixCache, KVManager
from hybridkv.memory import OutOfMemory, UnifiedMemory
from hybridkv.spec import Parallel, ShardSpec, WindowPool, get_preset

PS = 16


def make(policy: str = "lru", budget: int = 4_000_000, max_context: int = 2048) -> HybridRadixCache:
    mem = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-dense")), budget, page_size=PS, max_context=max_context, chunk_tokens=256
    )
    return HybridRadixCache(mem, policy=policy)


def put(cache: HybridRadixCache, tokens, priority: int = 0) -> None:
    toks = np.asarray(tokens, dtype=np.int64)
    m = cache.match_prefix(toks)
    row = np.concatenate([m.pages, KVManager(cache).alloc_pages(toks.size // PS - m.pages.size)])
    cache.insert(toks, row, priority=priority)


def full(cache: HybridRadixCache) -> str:
    """The full-attention pool's id (as the memory names it)."""
    (pool,) = cache.rules.full.pools
    return pool


def seq(base: int, n: int = 32) -> np.ndarray:
    return base * 10_000 + np.arange(n)


def survivors(cache: HybridRadixCache, bases: list[int]) -> list[int]:
    return [b for b in bases if cache.match_prefix(seq(b)).length]


def test_policies_by_name_and_unknown_name():
    assert sorted(POLICIES) == ["cost", "lfu", "lru", "priority"]
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make("fifo")


def test_lru_evicts_least_recently_used_leaf():
    cache = make("lru")
    for b in (1, 2, 3):
        put(cache, seq(b))
    cache.match_prefix(seq(1))
    assert cache.evict({full(cache): 2}) == {full(cache): 2, PAGE_NEED: 2}
    assert survivors(cache, [1, 2, 3]) == [1, 3]
    cache.check()


def test_lfu_evicts_fewest_hits():
    cache = make("lfu")
    for b in (1, 2, 3):
        put(cache, seq(b))
    for _ in range(3):
        cache.match_prefix(seq(1))
    cache.match_prefix(seq(3))
    cache.evict({full(cache): 2})
    assert survivors(cache, [1, 2, 3]) == [1, 3]
    cache.evict({full(cache): 2})
    assert survivors(cache, [1, 2, 3]) == [1]


def test_priority_evicts_lowest_priority_first():
    cache = make("priority")
    for b, prio in ((1, 5), (2, 1), (3, 3)):
        put(cache, seq(b), priority=prio)
    cache.evict({full(cache): 2})
    assert survivors(cache, [1, 2, 3]) == [1, 3]
    cache.evict({full(cache): 2})
    assert survivors(cache, [1, 2, 3]) == [1]


def test_cost_policy_keeps_expensive_recompute_where_lru_would_not():
    """Two equal-size leaves: one deep in a long context (its attention costs more to redo),
    inserted first; one at the start of a sequence, inserted last."""
    deep = np.concatenate([seq(7, 1024), seq(8, 16)])
    shallow = seq(9, 16)
    results = {}
    for policy in ("lru", "cost"):
        cache = make(policy)
        put(cache, deep)
        put(cache, shallow)
        cache.match_prefix(deep[:1024])  # keep the long prefix warm under both policies
        cache.evict({full(cache): 1})
        results[policy] = (cache.match_prefix(deep).length, cache.match_prefix(shallow).length)
        cache.check()
    assert results["lru"] == (1024, 16)  # LRU drops the older, expensive leaf
    assert results["cost"] == (1040, 0)  # cost-aware drops the cheap one


def test_locked_entries_are_never_evicted():
    cache = make("lru")
    put(cache, seq(1))
    put(cache, seq(2))
    lock = cache.lock(cache.match_prefix(seq(1)).node)
    assert cache.evict({full(cache): 100}) == {full(cache): 2, PAGE_NEED: 2}
    assert survivors(cache, [1, 2]) == [1]
    cache.unlock(lock)
    assert cache.evict({PAGE_NEED: 100}) == {full(cache): 2, PAGE_NEED: 2}
    assert cache.cached_tokens == 0
    cache.check()
    cache.mem.verify()


def test_allocation_evicts_what_is_short_and_fails_cleanly_when_all_is_locked():
    cache = make("lru", budget=600_000, max_context=256)
    mem = cache.mem
    bases = list(range(1, 100))
    for b in bases:  # fill the cache until the allocator would run out
        try:
            put(cache, seq(b))
        except OutOfMemory:
            break
    filled = cache.cached_pages
    assert filled > 4
    kvm = KVManager(cache)
    held = kvm.alloc_pages(4)  # needs evictions
    assert cache.cached_pages < filled and cache.counters.evicted_pages >= 1
    locks = [cache.lock(cache.match_prefix(seq(b)).node) for b in survivors(cache, bases)]
    before = (cache.cached_pages, mem.pages.live_count)
    with pytest.raises(OutOfMemory):
        kvm.alloc_pages(mem.available_pages() + 1)
    assert (cache.cached_pages, mem.pages.live_count) == before
    for lock in locks:
        cache.unlock(lock)
    mem.free_pages(held)
    cache.check()
    mem.verify()


def test_bad_needs_are_refused():
    cache = make()
    put(cache, seq(1))
    with pytest.raises(CacheError, match="unknown need \\['swa:8'\\]"):
        cache.evict({WindowPool(8): 1})
    with pytest.raises(CacheError, match=">= 0"):
        cache.evict({full(cache): -1})
    assert cache.cached_pages == 2


def test_a_pool_short_of_slabs_gets_them_from_cached_full_kv():
    """Windows all tombstoned, the full pool's cached pages spread over every full slab (one
    live cell each, holes exactly what the request needs): the window pool is short of slabs
    that only evicting full KV can give. Before: eviction tombstoned nothing and the request,
    which fits an empty memory, was refused."""
    ps = 4

    def memory() -> UnifiedMemory:
        shard = ShardSpec.whole(get_preset("tiny-swa"))
        return UnifiedMemory.create(shard, 150_000, page_size=ps, max_context=128, chunk_tokens=16)

    memory().alloc_pages(16)  # what an empty memory gives in one call
    mem = memory()
    cache = HybridRadixCache(mem)
    kvm = KVManager(cache)
    rows = []
    for _ in range(8):
        row = mem.alloc_pages(3)  # one full slab (3 cells)
        mem.windows.free(row)
        rows.append(row)
    for i, row in enumerate(rows):
        cache.insert(1000 * i + np.arange(ps), row[:1])  # window already released: nothing to tombstone
        mem.free_pages(row[1:])
    assert cache.stats()["window_resident_pages"] == {"swa:8": 0} and cache.cached_pages == 8
    (window,) = cache.rules.windows
    assert cache.evict({window.pool_id: 1}) == {}  # its own component has nothing left
    kv = kvm.admit(kvm.match(np.arange(50_000, 50_000 + 16 * ps)))
    kvm.extend(kv, 16 * ps)
    assert kv.n_pages == 16 and cache.counters.evicted_pages == 8
    kvm.release(kv)
    cache.check()
    mem.verify()


def test_evict_on_a_shard_without_full_attention_frees_what_it_can_and_does_not_raise() -> None:
    # PP stage 0 of 4 of tiny-gdn holds two recurrent layers only: no full pool, no page eviction rule
    shard = ShardSpec(get_preset("tiny-gdn"), Parallel(pp_size=4), 0, 0)
    mem = UnifiedMemory.create(shard, 1_000_000, page_size=PS, max_context=256, chunk_tokens=64)
    cache = HybridRadixCache(mem)
    assert not cache.rules.full.slots
    assert cache.evict({PAGE_NEED: mem.pages.capacity}) is not None
    mem.verify()
