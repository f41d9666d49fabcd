"""Bad input: a clear error naming what to change, and neither the tree nor the pools changed."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED, CacheError, HybridRadixCache, InsertError, LockError, RequestKV
from tests.cache.helpers import small_memory, tree_snapshot
from tests.memory.snapshots import assert_unchanged, snapshot

PS = 4


@pytest.fixture
def cache() -> HybridRadixCache:
    c = HybridRadixCache(small_memory("tiny-swa2-state", PS))
    toks = np.arange(16)
    row = c.alloc_pages(4)
    c.insert(toks, row, states={16: int(c.alloc_state(1)[0])})
    return c


def assert_refused(cache: HybridRadixCache, error: type[Exception], pattern: str, call, *args, **kwargs) -> None:
    mem_before, tree_before = snapshot(cache.mem), tree_snapshot(cache)
    with pytest.raises(error, match=pattern):
        call(*args, **kwargs)
    assert_unchanged(mem_before, cache.mem)
    assert tree_snapshot(cache) == tree_before
    cache.check()
    cache.mem.verify()


def test_unlock_without_lock(cache):
    lock = cache.lock(cache.match_prefix(np.arange(16)).node)
    cache.unlock(lock)
    assert_refused(cache, LockError, "already unlocked", cache.unlock, lock)
    other = HybridRadixCache(small_memory("tiny-swa2-state", PS))
    foreign = other.lock(other.match_prefix(np.arange(4)).node)
    assert_refused(cache, LockError, "not from this cache", cache.unlock, foreign)
    assert_refused(cache, LockError, "expected a CacheLock", cache.unlock, "lock")


def test_lock_of_a_node_not_in_the_cache(cache):
    node = cache.match_prefix(np.arange(16)).node
    cache.evict({PAGE_NEED: 100})
    assert_refused(cache, LockError, "not in this cache", cache.lock, node)
    other = HybridRadixCache(small_memory("tiny-swa2-state", PS))
    row = other.alloc_pages(1)
    foreign = other.insert(np.arange(4), row).node
    assert_refused(cache, LockError, "not in this cache", cache.lock, foreign)


def test_insert_of_pages_not_allocated(cache):
    dead = cache.alloc_pages(2)
    cache.mem.free_pages(dead)
    assert_refused(cache, InsertError, "not allocated", cache.insert, np.arange(100, 108), dead)
    assert_refused(cache, InsertError, "outside", cache.insert, np.arange(100, 104), [10**9])
    assert_refused(cache, InsertError, "sink", cache.insert, np.arange(100, 104), [0])


def test_insert_of_mismatched_lengths(cache):
    row = cache.alloc_pages(2)
    assert_refused(cache, InsertError, "9 tokens but 2 pages", cache.insert, np.arange(100, 109), row)
    assert_refused(cache, InsertError, "7 tokens but 2 pages", cache.insert, np.arange(100, 107), row)
    assert_refused(cache, CacheError, "1-D integer", cache.insert, np.arange(100, 108).reshape(2, 4), row)
    assert_refused(cache, InsertError, "1-D integer", cache.insert, np.arange(100, 108), row.astype(float))


def test_insert_of_a_page_twice_or_one_the_cache_holds_elsewhere(cache):
    row = cache.alloc_pages(2)
    assert_refused(cache, InsertError, "given twice", cache.insert, np.arange(100, 108), [row[0], row[0]])
    cached = cache.match_prefix(np.arange(16)).pages
    assert_refused(
        cache, InsertError, "already belongs to the cache", cache.insert, np.arange(100, 108), [row[0], cached[1]]
    )
    # the cache's own page at its own position is fine: that is a hit being re-inserted
    result = cache.insert(np.arange(8), cached[:2])
    assert result.freed_pages == 0


def test_insert_of_bad_states(cache):
    row = cache.alloc_pages(2)
    slot = int(cache.alloc_state(1)[0])
    toks = np.arange(100, 108)
    assert_refused(cache, InsertError, "multiple of the page size", cache.insert, toks, row, states={6: slot})
    assert_refused(cache, InsertError, "multiple of the page size", cache.insert, toks, row, states={12: slot})
    cache.mem.free_state([slot])
    assert_refused(cache, InsertError, "not allocated", cache.insert, toks, row, states={8: slot})
    cached_slot = cache.match_prefix(np.arange(16)).state
    assert_refused(cache, InsertError, "already a cached checkpoint", cache.insert, toks, row, states={8: cached_slot})
    dense = HybridRadixCache(small_memory("tiny-dense", PS))
    assert_refused(dense, InsertError, "no recurrent layers", dense.insert, toks, dense.alloc_pages(2), states={8: 1})


def test_insert_with_a_pinned_duplicate(cache):
    dup = cache.alloc_pages(4)
    gate = cache.mem.pin(pages=dup[:1])
    assert_refused(cache, InsertError, "pinned", cache.insert, np.arange(16), dup)
    gate.release()
    assert cache.insert(np.arange(16), dup).freed_pages == 4


def test_bad_tokens_and_keys(cache):
    assert_refused(cache, CacheError, "1-D integer", cache.match_prefix, np.zeros((2, 2), dtype=np.int64))
    assert_refused(cache, CacheError, "1-D integer", cache.match_prefix, [0.5, 1.5])
    assert_refused(cache, CacheError, "hashable", cache.match_prefix, [1, 2, 3, 4], ["unhashable"])


def test_request_row_refuses_a_wrong_page_count(cache):
    kv = RequestKV(cache, cache.match_prefix(np.arange(16)))
    assert_refused(cache, CacheError, "needs 1 fresh pages, got 2", kv.extend, 20, cache.alloc_pages(2))
