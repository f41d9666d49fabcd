"""Sliding-window rules: a hit needs its window resident; tombstones; scoped SWA locks; the
locked-full recovery that rebinds a request's window pages onto cached pages."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED, HybridRadixCache, RequestKV
from hybridkv.spec import FULL_POOL, WindowPool
from tests.cache.helpers import small_memory

PS = 4
SWA = WindowPool(8)  # tiny-swa: window 8 tokens = 2 pages


@pytest.fixture
def cache() -> HybridRadixCache:
    return HybridRadixCache(small_memory("tiny-swa", PS, budget=300_000))


def serve(cache: HybridRadixCache, tokens: np.ndarray, release_window: bool) -> RequestKV:
    """Match, allocate, optionally drop out-of-window SWA pages (as decode would), insert."""
    kv = RequestKV(cache, cache.match_prefix(tokens))
    kv.extend(tokens.size, cache.alloc_pages(kv.pages_needed(tokens.size)))
    if release_window:
        for pages in kv.window_release():
            if pages.size:
                cache.mem.free_window_pages(pages, SWA)
    n = tokens.size // PS
    kv.settle(cache.insert(tokens[: n * PS], kv.pages[:n]))
    cache.check()
    cache.mem.verify()
    return kv


def test_hit_needs_the_window_before_its_end(cache):
    toks = np.arange(24)
    kv = serve(cache, toks, release_window=True)  # pages 0-3 left the window, 4-5 are in it
    kv.unlock()
    assert list(cache.mem.resident(kv.pages, SWA)) == [False] * 4 + [True] * 2
    full = cache.match_prefix(toks)
    assert full.length == 24 and full.checkpoint_at is None
    inner = cache.match_prefix(toks[:16])  # window [8, 16) is tombstoned, so is every earlier one
    assert inner.length == 0 and inner.full_length == 16 and inner.swa_length == 0
    assert inner.checkpoint_at == 16


def test_window_release_follows_the_sequence_and_keeps_the_checkpoint_window(cache):
    serve(cache, np.arange(8), release_window=False).unlock()
    toks = np.concatenate([np.arange(8), 100 + np.arange(24)])
    kv = RequestKV(cache, cache.match_prefix(toks[:16]))
    assert kv.cached == 2 and kv.keep == [(0, 0)]
    kv.extend(20, cache.alloc_pages(kv.pages_needed(20)))
    (gone,) = kv.window_release()  # window of 20 tokens is [12, 20): page 2 left it (the cache's 0-1 stay)
    assert np.array_equal(gone, kv.pages[2:3])
    cache.mem.free_window_pages(gone, SWA)
    kv.extend(32, cache.alloc_pages(kv.pages_needed(32)))
    (gone,) = kv.window_release()
    assert np.array_equal(gone, kv.pages[3:6])
    cache.mem.free_window_pages(gone, SWA)
    assert kv.window_release()[0].size == 0
    cache.mem.free_pages(kv.own_pages())
    kv.unlock()
    cache.mem.verify()


def test_locked_full_recovery_rebinds_window_pages_by_row_position(cache):
    toks = np.arange(24)
    holder = serve(cache, toks, release_window=True)  # keeps its lock: full KV of [0, 24) is locked
    miss = cache.match_prefix(toks[:16])
    assert miss.length == 0 and miss.checkpoint_at == 16
    kv = RequestKV(cache, miss)
    assert kv.keep == [(2, 4)]  # the window before the checkpoint stays resident
    fresh = cache.alloc_pages(5)[::-1].copy()  # descending ids: sorting would pair them wrongly
    kv.extend(20, fresh)
    (gone,) = kv.window_release()
    cache.mem.free_window_pages(gone, SWA)
    assert np.array_equal(gone, fresh[:2])  # pages 0-1 left; 2-3 kept for the checkpoint; 4 in window
    pool = cache.mem.pools[SWA]
    cells = pool.v2p[fresh].copy()
    result = cache.insert(toks[:16], fresh[:4])
    cached = result.pages
    assert result.prefix_len == 16 and result.freed_pages == 4 and result.adopted_pages == 2
    assert np.array_equal(pool.v2p[cached[2:4]], cells[2:4])  # page i took the cells of page i
    assert not pool.resident(cached[:2]).any()
    assert not cache.mem.pages.live[fresh[:4]].any()
    cache.check()
    cache.mem.verify()
    assert cache.match_prefix(toks[:16]).length == 16  # the hit there is valid now
    kv.settle(result)
    cache.mem.free_pages(kv.own_pages())
    kv.unlock()
    holder.unlock()
    cache.check()


def test_swa_lock_covers_only_the_window(cache):
    for end in (8, 16, 24):
        serve(cache, np.arange(end), release_window=False).unlock()
    m = cache.match_prefix(np.arange(24))
    lock = cache.lock(m.node)
    assert [n.swa_lock for n in m.node.path()] == [0, 0, 1] and [n.lock for n in m.node.path()] == [1, 1, 1]
    freed = cache.evict({SWA: 100})
    assert freed == {SWA: 4}  # [0, 8) and [8, 16) tombstoned; the locked window stays; no full KV
    assert cache.match_prefix(np.arange(24)).length == 24
    assert cache.match_prefix(np.arange(16)).length == 0
    cache.check()
    cache.mem.verify()
    cache.unlock(lock)
    # now the leaf goes whole; its tombstoned parents hold no window pages, so they stay
    assert cache.evict({SWA: 100}) == {FULL_POOL: 2, SWA: 2, PAGE_NEED: 2}
    assert cache.cached_tokens == 16
    cache.check()


def test_two_windows_must_both_hold():
    cache = HybridRadixCache(small_memory("tiny-swa2-state", PS))
    toks = np.arange(32)
    kv = RequestKV(cache, cache.match_prefix(toks))
    kv.extend(32, cache.alloc_pages(8))
    cache.mem.free_window_pages(kv.pages[2:6], WindowPool(8))  # window 8 at 32 needs pages 6-7 only
    cache.mem.free_window_pages(kv.pages[2:3], WindowPool(24))  # window 24 at 32 needs pages 2-7
    slot = int(cache.alloc_state(1)[0])
    kv.settle(cache.insert(toks, kv.pages, states={32: slot}))
    kv.unlock()
    m = cache.match_prefix(toks)
    assert m.length == 0 and m.state_length == 32 and m.swa_length == 8
    cache.check()
    cache.mem.verify()


def test_check_catches_window_pages_freed_behind_the_cache(cache):
    kv = serve(cache, np.arange(16), release_window=False)
    kv.unlock()
    cache.mem.free_window_pages(kv.pages[:1], SWA)  # the cache owns these: a caller bug
    with pytest.raises(AssertionError, match="resident in swa:8"):
        cache.check()
