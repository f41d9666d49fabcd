"""Misuse of the cache from outside: freeing what the cache holds, namespaces that were never
inserted, arguments of the wrong type. Each is refused before anything changes (or creates
nothing), with an error naming what to change."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED, CacheError, HybridRadixCache, InsertError, KVManager, LockError
from hybridkv.memory import InvalidIds, OutOfMemory, TokenAllocator
from hybridkv.spec import PoolId
from tests.cache.helpers import small_memory
from tests.cache.test_bad_input import assert_refused

PS = 4


@pytest.fixture
def cache() -> HybridRadixCache:
    c = HybridRadixCache(small_memory("tiny-swa2-state", PS))
    row = c.mem.alloc_pages(4)
    c.insert(np.arange(16), row, checkpoints={16: int(c.mem.alloc_state(1)[0])})
    return c


# --- pages and slots the cache holds are freed by the cache only ----------------------------


def test_freeing_cached_pages_is_refused_and_they_are_never_reallocated(cache):
    mem = cache.mem
    hit = cache.match_prefix(np.arange(16))
    pages, slot = hit.pages.copy(), hit.checkpoint
    window = next(iter(p for p in mem.pools if p.releases_history))
    ps = mem.page_size
    assert_refused(cache, InvalidIds, f"page {pages[0]} is held by the prefix cache", mem.free_pages, pages)
    assert_refused(cache, InvalidIds, "held by the prefix cache", mem.free_pages, [int(pages[2])])
    assert_refused(cache, InvalidIds, "held by the prefix cache", TokenAllocator(mem).free, pages * ps)
    assert_refused(
        cache,
        InvalidIds,
        "held by the prefix cache",
        TokenAllocator(mem).free_segment,
        np.arange(16) + pages[0] * ps,
        0,
    )
    assert_refused(cache, InvalidIds, "held by the prefix cache", mem.windows.free, pages[3:], window)
    assert_refused(cache, InvalidIds, "held by the prefix cache", mem.windows.free_outside_span, pages, 16)
    assert_refused(cache, InvalidIds, f"slot {slot} is held by the prefix cache", mem.free_state, [slot])
    with pytest.raises(InvalidIds, match="held by the prefix cache"), mem.free_group():
        mem.free_pages(pages[:1])
    cache.check()
    mem.verify()
    fresh = []
    with pytest.raises(OutOfMemory):  # take every page the memory can give: none is a cached one
        while True:
            fresh.append(mem.alloc_pages(1))
    assert fresh and not np.isin(pages, np.concatenate(fresh)).any()
    again = cache.match_prefix(np.arange(16))
    assert again.length == 16 and np.array_equal(again.pages, pages)


def test_the_cache_frees_its_own_pages_on_eviction(cache):
    mem = cache.mem
    pages = cache.match_prefix(np.arange(16)).pages.copy()
    assert cache.evict({PAGE_NEED: 4})[PAGE_NEED] == 4
    assert not mem.pages.live[pages].any() and not mem.pages.held[pages].any()
    row = mem.alloc_pages(4)
    mem.free_pages(row)  # a page the cache no longer holds frees as usual
    cache.check()
    mem.verify()


def test_a_second_cache_on_memory_another_cache_holds_is_refused(cache):
    with pytest.raises(CacheError, match="already holds"):
        HybridRadixCache(cache.mem)


# --- namespaces -----------------------------------------------------------------------------


def test_matching_unknown_namespaces_creates_nothing():
    cache = HybridRadixCache(small_memory("tiny-swa2-state", PS))
    kvm = KVManager(cache)
    for salt in range(200):
        match = cache.match_prefix(np.arange(16), extra_key=("tenant", salt))
        assert match.length == 0 and match.pages.size == 0
    assert not cache.tree.roots
    # an empty hit in an unknown namespace still admits, runs and inserts
    kv = kvm.admit(kvm.match(np.arange(16), "new"), "new")
    kvm.extend(kv, 16)
    kvm.finish(kv, np.arange(16))
    assert list(cache.tree.roots) == ["new"]
    assert cache.match_prefix(np.arange(16), "new").full_length == 16
    cache.check()


def test_a_root_goes_with_its_last_node():
    cache = HybridRadixCache(small_memory("tiny-dense", PS))
    for ns in ("a", "b"):
        cache.insert(np.arange(8), cache.mem.alloc_pages(2), extra_key=ns)
    empty = cache.match_prefix(np.arange(8), "c")
    lock = cache.lock(empty.node)  # an empty hit's lock protects nothing, even once the root is gone
    cache.evict({PAGE_NEED: 100})
    assert not cache.tree.roots and cache.num_nodes == 0
    cache.unlock(lock)
    cache.check()
    cache.mem.verify()


# --- argument types at the API edge ---------------------------------------------------------


def test_insert_refuses_bad_argument_types(cache):
    row = cache.mem.alloc_pages(2)
    slot = int(cache.mem.alloc_state(1)[0])
    toks = np.arange(100, 108)
    assert_refused(cache, CacheError, "checkpoints must be a mapping", cache.insert, toks, row, checkpoints=[slot])
    assert_refused(cache, CacheError, "checkpoints must be a mapping", cache.insert, toks, row, checkpoints=7)
    assert_refused(cache, CacheError, "a position must be an integer", cache.insert, toks, row, checkpoints={"8": slot})
    assert_refused(cache, CacheError, "a state slot must be an integer", cache.insert, toks, row, checkpoints={8: 1.0})
    assert_refused(cache, CacheError, "priority must be an integer", cache.insert, toks, row, priority="high")
    assert_refused(cache, CacheError, "priority must be an integer", cache.insert, toks, row, priority=None)
    assert_refused(cache, InsertError, "1-D integer", cache.insert, toks, "pages")
    assert_refused(cache, CacheError, "1-D integer", cache.insert, "tokens", row)


def test_evict_refuses_bad_argument_types(cache):
    (full,) = cache.rules.full.pools
    assert_refused(cache, CacheError, "needs must be a mapping", cache.evict, 5)
    assert_refused(cache, CacheError, "needs must be a mapping", cache.evict, [(full, 1)])
    assert_refused(cache, CacheError, r"needs\[full\] must be an integer", cache.evict, {full: "2"})
    assert_refused(cache, CacheError, r"needs\[full\] must be an integer", cache.evict, {full: 1.5})
    assert_refused(cache, CacheError, r"needs\[full\] must be an integer", cache.evict, {full: True})
    assert_refused(cache, CacheError, r"must be >= 0", cache.evict, {full: -1})
    assert_refused(cache, CacheError, "unknown need", cache.evict, {"full": 1})
    assert_refused(cache, CacheError, "unknown need", cache.evict, {PoolId.parse("swa:999"): 1})


def test_lock_and_constructor_refuse_bad_argument_types(cache):
    assert_refused(cache, LockError, "expected a Node", cache.lock, "node")
    with pytest.raises(CacheError, match="max_checkpoints_per_path must be an integer"):
        HybridRadixCache(small_memory("tiny-dense", PS), max_checkpoints_per_path="8")
    with pytest.raises(CacheError, match="policy must be"):
        HybridRadixCache(small_memory("tiny-dense", PS), policy=3)


def test_manager_refuses_bad_argument_types(cache):
    kvm = KVManager(cache)
    kv = kvm.admit(kvm.match(np.arange(16)))
    assert_refused(cache, CacheError, "count must be an integer", kvm.alloc_pages, 2.0)
    assert_refused(cache, CacheError, "count must be >= 0", kvm.alloc_pages, -1)
    assert_refused(cache, CacheError, "count must be an integer", kvm.alloc_state, "1")
    assert_refused(cache, CacheError, "1-D sequence of slot ids", kvm.fork_state, 3)
    assert_refused(cache, CacheError, "expected a MatchResult", kvm.admit, "match")
    assert_refused(cache, CacheError, "expected a KVHandle", kvm.extend, "kv", 20)
    assert_refused(cache, CacheError, "new_len must be an integer", kvm.extend, kv, 20.0)
    assert_refused(cache, CacheError, "sequence of KVHandles", kvm.extend_batch, kv, [20])
    assert_refused(cache, CacheError, "one new length per handle", kvm.extend_batch, [kv], 20)
    assert_refused(cache, CacheError, "new_lens must be an integer", kvm.extend_batch, [kv], ["20"])
    assert_refused(cache, CacheError, "sequence of KVHandles", kvm.release_windows, kv)
    assert_refused(cache, CacheError, "at must be an integer", kvm.checkpoints.reserve, kv, 20.0)
    assert_refused(cache, CacheError, "1-D integer", kvm.insert, kv, np.arange(16.0))
    assert_refused(cache, CacheError, "expected a KVHandle", kvm.insert, None, np.arange(16))
    assert_refused(cache, CacheError, "expected a KVHandle", kvm.release, 0)
    assert_refused(cache, CacheError, "expected a KVHandle", kvm.pin, [kv])
    with pytest.raises(CacheError, match="expected a HybridRadixCache"):
        KVManager(cache.mem)
    kvm.release(kv)
