"""Radix structure on a full-attention model: page-aligned keys, splits, dedupe, namespaces."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import HybridRadixCache, KVManager
from tests.cache.helpers import small_memory

PS = 4


@pytest.fixture
def cache() -> HybridRadixCache:
    return HybridRadixCache(small_memory("tiny-dense", PS, budget=400_000))


def put(cache: HybridRadixCache, tokens, extra_key=None):
    """Match, allocate the rest, insert the aligned part, free the tail: one request."""
    toks = np.asarray(tokens, dtype=np.int64)
    m = cache.match_prefix(toks, extra_key)
    lock = cache.lock(m.node)
    fresh = cache.mem.alloc_pages(-(-toks.size // PS) - m.pages.size)
    row = np.concatenate([m.pages, fresh])
    n = toks.size // PS
    result = cache.insert(toks[: n * PS], row[:n], extra_key=extra_key)
    cache.mem.free_pages(row[n:])
    cache.unlock(lock)
    cache.check()
    cache.mem.verify()
    return m, result


def test_hit_is_page_aligned_and_unaligned_tail_is_not_cached(cache):
    _, first = put(cache, range(10))  # 2 whole pages cached, the tail page freed
    assert first.prefix_len == 0 and first.pages.size == 2
    assert cache.cached_tokens == 8
    m = cache.match_prefix(list(range(10)))
    assert m.length == 8 and np.array_equal(m.pages, first.pages)
    assert cache.match_prefix(list(range(7))).length == 4  # the second page is incomplete
    assert cache.match_prefix([0, 1, 2, 9]).length == 0  # a page matches whole or not at all


def test_divergence_splits_a_node_and_shares_the_prefix(cache):
    _, a = put(cache, range(16))
    m, b = put(cache, [*range(8), 50, 51, 52, 53, 54, 55, 56, 57])
    assert m.length == 8 and b.prefix_len == 8
    assert np.array_equal(b.pages[:2], a.pages[:2]) and not np.isin(b.pages[2:], a.pages).any()
    assert cache.num_nodes == 3  # shared [0, 8) + two branches
    assert cache.match_prefix(list(range(16))).length == 16
    assert cache.match_prefix([*range(8), 50, 51, 52, 53]).length == 12


def test_match_splits_where_the_hit_ends_so_a_lock_covers_exactly_it(cache):
    put(cache, range(16))
    m = cache.match_prefix([*range(8), 99, 99, 99, 99])
    assert m.length == 8 and m.node.end == 8 and cache.num_nodes == 2
    lock = cache.lock(m.node)
    assert m.node.lock == 1 and next(iter(m.node.children.values())).lock == 0
    cache.unlock(lock)
    cache.check()


def test_insert_frees_duplicate_pages_the_request_computed(cache):
    _, a = put(cache, range(12))
    kvm = KVManager(cache)
    kv = kvm.admit(kvm.match([]))  # a second request computed the same 12 tokens itself
    kvm.extend(kv, 12)
    own = kv.own_pages().copy()
    result = kvm.insert(kv, np.arange(12))
    assert result.prefix_len == 12 and np.array_equal(result.duplicates, own)
    assert np.array_equal(result.pages, a.pages) and np.array_equal(kv.pages, a.pages)
    assert not cache.mem.pages.live[own].any()
    kvm.release(kv)
    cache.check()
    cache.mem.verify()


def test_extra_key_namespaces_never_share(cache):
    put(cache, range(12), extra_key="tenant-a")
    assert cache.match_prefix(list(range(12)), "tenant-b").length == 0
    assert cache.match_prefix(list(range(12))).length == 0
    assert cache.match_prefix(list(range(12)), "tenant-a").length == 12
    _, b = put(cache, range(12), extra_key="tenant-b")
    assert b.prefix_len == 0  # its own copy, not a duplicate of tenant-a's
    assert cache.cached_tokens == 24


def test_hit_pages_are_read_only_views(cache):
    put(cache, range(8))
    m = cache.match_prefix(list(range(8)))
    with pytest.raises(ValueError, match="read-only"):
        m.pages[0] = 7
