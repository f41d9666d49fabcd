"""Bad input: a clear error naming what to change, and neither the tree nor the pools changed."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED, CacheError, HandleStatus, HybridRadixCache, InsertError, KVManager, LockError
from hybridkv.memory import GateStatus
from tests.cache.helpers import small_memory, tree_snapshot
from tests.memory.snapshots import assert_unchanged, snapshot

PS = 4


@pytest.fixture
def cache() -> HybridRadixCache:
    c = HybridRadixCache(small_memory("tiny-swa2-state", PS))
    toks = np.arange(16)
    row = c.mem.alloc_pages(4)
    c.insert(toks, row, checkpoints={16: int(c.mem.alloc_state(1)[0])})
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
    row = other.mem.alloc_pages(1)
    foreign = other.insert(np.arange(4), row).node
    assert_refused(cache, LockError, "not in this cache", cache.lock, foreign)


def test_insert_of_pages_not_allocated(cache):
    dead = cache.mem.alloc_pages(2)
    cache.mem.free_pages(dead)
    assert_refused(cache, InsertError, "not allocated", cache.insert, np.arange(100, 108), dead)
    assert_refused(cache, InsertError, "outside", cache.insert, np.arange(100, 104), [10**9])
    assert_refused(cache, InsertError, "sink", cache.insert, np.arange(100, 104), [0])


def test_insert_of_mismatched_lengths(cache):
    row = cache.mem.alloc_pages(2)
    assert_refused(cache, InsertError, "9 tokens but 2 pages", cache.insert, np.arange(100, 109), row)
    assert_refused(cache, InsertError, "7 tokens but 2 pages", cache.insert, np.arange(100, 107), row)
    assert_refused(cache, CacheError, "1-D integer", cache.insert, np.arange(100, 108).reshape(2, 4), row)
    assert_refused(cache, InsertError, "1-D integer", cache.insert, np.arange(100, 108), row.astype(float))


def test_insert_of_a_page_twice_or_one_the_cache_holds_elsewhere(cache):
    row = cache.mem.alloc_pages(2)
    assert_refused(cache, InsertError, "given twice", cache.insert, np.arange(100, 108), [row[0], row[0]])
    cached = cache.match_prefix(np.arange(16)).pages
    assert_refused(
        cache, InsertError, "already belongs to the cache", cache.insert, np.arange(100, 108), [row[0], cached[1]]
    )
    # the cache's own page at its own position is fine: that is a hit being re-inserted
    result = cache.insert(np.arange(8), cached[:2])
    assert result.duplicates.size == 0


def test_insert_of_bad_states(cache):
    row = cache.mem.alloc_pages(2)
    slot = int(cache.mem.alloc_state(1)[0])
    toks = np.arange(100, 108)
    assert_refused(cache, InsertError, "multiple of the page size", cache.insert, toks, row, checkpoints={6: slot})
    assert_refused(cache, InsertError, "multiple of the page size", cache.insert, toks, row, checkpoints={12: slot})
    cache.mem.free_state([slot])
    assert_refused(cache, InsertError, "not allocated", cache.insert, toks, row, checkpoints={8: slot})
    cached_slot = cache.match_prefix(np.arange(16)).checkpoint
    cached = {8: cached_slot}
    assert_refused(cache, InsertError, "already a cached checkpoint", cache.insert, toks, row, checkpoints=cached)
    dense = HybridRadixCache(small_memory("tiny-dense", PS))
    dense_row = dense.mem.alloc_pages(2)
    assert_refused(dense, InsertError, "no recurrent layers", dense.insert, toks, dense_row, checkpoints={8: 1})


def test_insert_with_a_pinned_duplicate(cache):
    dup = cache.mem.alloc_pages(4)
    gate = cache.mem.pin(pages=dup[:1])
    assert_refused(cache, InsertError, "pinned", cache.insert, np.arange(16), dup)
    gate.release()
    result = cache.insert(np.arange(16), dup)
    assert np.array_equal(result.duplicates, dup) and cache.mem.pages.live[dup].all()  # the caller frees them


def test_bad_tokens_and_keys(cache):
    assert_refused(cache, CacheError, "1-D integer", cache.match_prefix, np.zeros((2, 2), dtype=np.int64))
    assert_refused(cache, CacheError, "1-D integer", cache.match_prefix, [0.5, 1.5])
    assert_refused(cache, CacheError, "hashable", cache.match_prefix, [1, 2, 3, 4], ["unhashable"])


def test_request_row_refuses_a_wrong_page_count(cache):
    kv = KVManager(cache).admit(cache.match_prefix(np.arange(16)))
    assert_refused(cache, CacheError, "needs 1 fresh pages, got 2", kv.grow, 20, cache.mem.alloc_pages(2))


def test_manager_refuses_misuse_of_a_request(cache):
    kvm = KVManager(cache)
    kv = kvm.admit(kvm.match(np.arange(16)))
    kvm.extend(kv, 22)
    assert_refused(cache, CacheError, "cannot shrink", kvm.extend, kv, 21)
    assert_refused(cache, CacheError, "holds KV of 22 tokens", kvm.insert, kv, np.arange(23))
    assert_refused(cache, CacheError, "fewer than the 4 pages", kvm.insert, kv, np.arange(12))
    assert_refused(cache, CacheError, "past the cached 16 tokens", kvm.checkpoints.reserve, kv, 16)
    assert_refused(cache, CacheError, "multiple of the page size", kvm.checkpoints.reserve, kv, 22)
    assert_refused(cache, CacheError, "multiple of the page size", kvm.checkpoints.take, kv)  # 22 is not aligned
    assert_refused(cache, CacheError, "multiple of the page size", kvm.checkpoints.take_final, kv)
    assert kv.state_slot is not None  # refused: the running slot stays
    assert_refused(cache, CacheError, "repeat one", kvm.checkpoints.reserve_each, kv, [20, 20])
    assert_refused(cache, CacheError, "multiple of the page size", kvm.checkpoints.reserve_each, kv, [20, 22])
    assert kv.checkpoints == {}  # a refused batch reserves none of its positions
    assert kvm.checkpoints.reserve_each(kv, []) == []
    other = kvm.admit(kvm.match(np.arange(100, 116)))
    kvm.extend(other, 24)
    assert_refused(cache, CacheError, "one position per handle", kvm.checkpoints.reserve_step, [kv, other], [20])
    assert_refused(cache, CacheError, "repeat one", kvm.checkpoints.reserve_step, [kv, kv], [20, 20])
    assert_refused(cache, CacheError, "multiple of the page size", kvm.checkpoints.reserve_step, [kv, other], [20, 22])
    assert kv.checkpoints == {} and other.checkpoints == {}  # refused: none reserved
    assert kvm.checkpoints.reserve_step([], []).size == 0
    slots = kvm.checkpoints.reserve_step([kv, other], [20, 24])
    assert (kv.checkpoints, other.checkpoints) == ({20: int(slots[0])}, {24: int(slots[1])})
    third = kvm.admit(kvm.match(np.arange(200, 216)))
    kvm.release(third)
    assert_refused(cache, CacheError, "appears twice", kvm.release_all, [other, other])
    assert_refused(cache, CacheError, "released already", kvm.release_all, [other, third])
    assert other.status is HandleStatus.RUNNING  # refused: none released
    assert_refused(cache, CacheError, "one token sequence per handle", kvm.finish_all, [other], [])
    kvm.release_all([other])
    assert other.status is HandleStatus.RELEASED and other.state_slot is None and not other.checkpoints
    gate = kvm.pin(kv)
    assert_refused(cache, CacheError, "unpin it first", kvm.release, kv)
    kvm.unpin(kv)
    assert gate.status is GateStatus.RELEASED
    kvm.release(kv)
    assert_refused(cache, CacheError, "released already", kvm.release, kv)
    assert_refused(cache, CacheError, "released", kvm.extend, kv, 30)
    dense = KVManager(HybridRadixCache(small_memory("tiny-dense", PS)))
    plain = dense.admit(dense.match(np.arange(8)))
    assert plain.state_slot is None
    dense.extend(plain, 8)
    assert_refused(dense.cache, CacheError, "no recurrent layers", dense.checkpoints.reserve, plain, 8)
    assert_refused(dense.cache, CacheError, "no recurrent layers", dense.alloc_state, 1)
