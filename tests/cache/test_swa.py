"""Sliding-window rules: a hit needs its window resident; tombstones; scoped SWA locks; the
locked-full recovery that rebinds a request's window pages onto cached pages. Tests of the
tombstone rules release windows eagerly (``park_windows=False``); window-cached release (the
default) is in ``test_window_cached.py``."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED, HybridRadixCache, KVHandle, KVManager
from hybridkv.memory import InvalidIds
from hybridkv.spec import WindowPool
from tests.cache.helpers import small_memory

PS = 4


@pytest.fixture
def cache() -> HybridRadixCache:
    return HybridRadixCache(small_memory("tiny-swa", PS, budget=300_000))


def swa(cache: HybridRadixCache):
    """tiny-swa's window pool (window 8 tokens = 2 pages), as the memory names it."""
    (w,) = cache.rules.windows
    assert w.pool_id == WindowPool(8)
    return w.pool_id


def serve(
    cache: HybridRadixCache, tokens: np.ndarray, release_window: bool, park: bool = False
) -> tuple[KVManager, KVHandle]:
    """Match, admit, extend, optionally release out-of-window pages (as decode would: freed, or
    window-cached with ``park``), insert."""
    kvm = KVManager(cache, park_windows=park)
    kv = kvm.admit(kvm.match(tokens))
    kvm.extend(kv, tokens.size)
    if release_window:
        kvm.release_windows([kv])
    kvm.insert(kv, tokens)
    cache.check()
    cache.mem.verify()
    return kvm, kv


def test_hit_needs_the_window_before_its_end(cache):
    toks = np.arange(24)
    kvm, kv = serve(cache, toks, release_window=True)  # pages 0-3 left the window, 4-5 are in it
    pages = kv.pages.copy()
    kvm.release(kv)
    assert list(cache.mem.resident(pages, swa(cache))) == [False] * 4 + [True] * 2
    full = cache.match_prefix(toks)
    assert full.length == 24 and full.checkpoint_at is None
    inner = cache.match_prefix(toks[:16])  # window [8, 16) is tombstoned, so is every earlier one
    assert inner.length == 0 and inner.full_length == 16 and inner.window_length == 0
    assert inner.checkpoint_at == 16


def test_window_release_follows_the_sequence_and_keeps_the_checkpoint_window(cache):
    kvm, first = serve(cache, np.arange(8), release_window=False)
    kvm.release(first)
    toks = np.concatenate([np.arange(8), 100 + np.arange(24)])
    kv = kvm.admit(kvm.match(toks[:16]))
    assert kv.cached == 2 and kv.keep == [(0, 0)]
    kvm.extend(kv, 20)
    pool = cache.mem.pools[swa(cache)]
    assert kvm.release_windows([kv]) == 1  # window of 20 tokens is [12, 20): page 2 left it (the cache's 0-1 stay)
    assert list(pool.resident(kv.pages)) == [True, True, False, True, True]
    kvm.extend(kv, 32)
    assert kvm.release_windows([kv]) == 3
    assert list(pool.resident(kv.pages)) == [True] * 2 + [False] * 4 + [True] * 2
    assert kvm.release_windows([kv]) == 0
    own = kv.own_pages().copy()
    kvm.release(kv)
    assert not cache.mem.pages.live[own].any()
    cache.mem.verify()


def test_locked_full_recovery_rebinds_window_pages_by_row_position(cache):
    toks = np.arange(24)
    kvm, holder = serve(cache, toks, release_window=True)  # keeps its lock: full KV of [0, 24) is locked
    miss = kvm.match(toks[:16])
    assert miss.length == 0 and miss.checkpoint_at == 16
    kv = kvm.admit(miss)
    assert kv.keep == [(2, 4)]  # the window before the checkpoint stays resident
    fresh = kvm.alloc_pages(5)[::-1].copy()  # descending ids: sorting would pair them wrongly
    kv.grow(20, fresh)
    pool = cache.mem.pools[swa(cache)]
    assert kvm.release_windows([kv]) == 2
    assert not pool.resident(fresh[:2]).any() and pool.resident(fresh[2:]).all()
    # pages 0-1 left; 2-3 kept for the checkpoint; 4 in window
    cells = pool.v2p[fresh].copy()
    result = kvm.insert(kv, toks[:16])
    cached = result.pages
    assert result.prefix_len == 16 and np.array_equal(result.duplicates, fresh[:4]) and result.adopted_pages == 2
    assert np.array_equal(pool.v2p[cached[2:4]], cells[2:4])  # page i took the cells of page i
    assert not pool.resident(cached[:2]).any()
    assert not cache.mem.pages.live[fresh[:4]].any()
    assert np.array_equal(kv.pages, np.concatenate([cached, fresh[4:]]))
    cache.check()
    cache.mem.verify()
    assert cache.match_prefix(toks[:16]).length == 16  # the hit there is valid now
    kvm.release(kv)
    kvm.release(holder)
    cache.check()


def test_swa_lock_covers_only_the_window(cache):
    for end in (8, 16, 24):
        kvm, kv = serve(cache, np.arange(end), release_window=False)
        kvm.release(kv)
    m = cache.match_prefix(np.arange(24))
    lock = cache.lock(m.node)
    assert [n.window_lock for n in m.node.path()] == [0, 0, 1] and [n.lock for n in m.node.path()] == [1, 1, 1]
    freed = cache.evict({swa(cache): 100})
    assert freed == {swa(cache): 4}  # [0, 8) and [8, 16) tombstoned; the locked window stays; no full KV
    assert cache.match_prefix(np.arange(24)).length == 24
    assert cache.match_prefix(np.arange(16)).length == 0
    cache.check()
    cache.mem.verify()
    cache.unlock(lock)
    # now the leaf goes whole; its tombstoned parents hold no window pages, so they stay
    assert cache.evict({swa(cache): 100}) == {cache.rules.full.pools[0]: 2, swa(cache): 2, PAGE_NEED: 2}
    assert cache.cached_tokens == 16
    cache.check()


def test_two_windows_must_both_hold():
    cache = HybridRadixCache(small_memory("tiny-swa2-state", PS))
    w8, w24 = WindowPool(8), WindowPool(24)
    kvm = KVManager(cache)
    toks = np.arange(32)
    kv = kvm.admit(kvm.match(toks))
    kvm.extend(kv, 32)
    cache.mem.windows.free(kv.pages[2:6], w8)  # window 8 at 32 needs pages 6-7 only
    cache.mem.windows.free(kv.pages[2:3], w24)  # window 24 at 32 needs pages 2-7
    kvm.checkpoints.reserve(kv, 32)
    kvm.finish(kv, toks)
    m = cache.match_prefix(toks)
    assert m.length == 0 and m.checkpoint_length == 32 and m.window_length == 8
    cache.check()
    cache.mem.verify()


def test_window_pages_freed_behind_the_cache_are_refused_and_check_catches_them(cache):
    kvm, kv = serve(cache, np.arange(16), release_window=False)
    kvm.release(kv)
    with pytest.raises(InvalidIds, match="held by the prefix cache"):  # the cache owns these: a caller bug
        cache.mem.windows.free(kv.pages[:1], swa(cache))
    cache.check()
    cache.mem.windows.free(kv.pages[:1], swa(cache), by=cache.residency)  # forced in its name
    with pytest.raises(AssertionError, match="resident in swa:8"):
        cache.check()
