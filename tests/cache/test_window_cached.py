"""Window-cached pages: window cells that left a running request's window stay resident, held by
the cache, until memory is needed. A hit inside them is valid once the request inserted them;
eviction reclaims them before anything the tree holds and never a page a request still needs;
a release without insert frees them; memory and tree checks count them as their own category."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED, HybridRadixCache, KVManager
from hybridkv.memory import InvalidIds, OutOfMemory
from hybridkv.spec import WindowPool
from tests.cache.helpers import small_memory

PS = 4
W = WindowPool(8)  # tiny-swa's window: 8 tokens, 2 pages


@pytest.fixture
def cache() -> HybridRadixCache:
    return HybridRadixCache(small_memory("tiny-swa", PS, budget=300_000))


def checked(cache: HybridRadixCache) -> None:
    cache.check()
    cache.mem.verify()


def test_a_hit_ending_inside_the_released_span_is_valid(cache):
    """Fails with eager release: the window [8, 16) of a hit at 16 left the window at 24."""
    kvm = KVManager(cache)
    toks = np.arange(24)
    kv = kvm.admit(kvm.match(toks))
    kvm.extend(kv, 24)
    assert kvm.release_windows([kv]) == 4  # pages 0-3 left the window of 24 tokens
    checked(cache)
    kvm.finish(kv, toks)
    checked(cache)
    for end in (8, 12, 16, 20, 24):
        m = kvm.match(toks[:end])
        assert m.length == end and m.window_length == end and m.checkpoint_at is None


def test_window_cached_pages_are_counted_apart_and_join_the_tree_on_insert(cache):
    kvm = KVManager(cache)
    toks = np.arange(24)
    kv = kvm.admit(kvm.match(toks))
    kvm.extend(kv, 24)
    kvm.release_windows([kv])
    assert cache.stats()["window_cached_pages"] == {str(W): 4}
    assert cache.mem.stats().pools[list(cache.mem.pools).index(W)].cached_cells == 4
    assert cache.cached_pages == 0 and cache.mem.pools[W].live_count == 6
    kvm.finish(kv, toks)
    assert cache.stats()["window_cached_pages"] == {str(W): 0}, "inserted: the tree node holds them now"
    (node,) = cache.tree.leaves
    assert node.window_resident == [6] and cache.mem.pools[W].live_count == 6, "no double count"
    checked(cache)


def test_a_request_released_without_insert_frees_its_window_cached_pages(cache):
    kvm = KVManager(cache)
    kv = kvm.admit(kvm.match(np.arange(40)))
    kvm.extend(kv, 40)
    kvm.release_windows([kv])
    own = kv.own_pages().copy()
    assert cache.residency.window_cache.count(cache.rules.windows[0]) == 8
    kvm.release(kv)
    assert not cache.mem.pages.live[own].any() and cache.residency.window_cache.total == 0
    checked(cache)
    assert cache.mem.pages.live_count == 0


def test_window_cached_cells_are_the_cache_s_until_it_drops_them(cache):
    kvm = KVManager(cache)
    kv = kvm.admit(kvm.match(np.arange(24)))
    kvm.extend(kv, 24)
    kvm.release_windows([kv])
    parked = kv.pages[:4]
    mem = cache.mem
    for call, args in [
        (mem.windows.free, (parked[:1], W)),
        (mem.windows.free, (parked[:1], W)),
        (mem.free_pages, (parked[:1],)),
        (mem.windows.free_outside_span, (kv.pages, 24)),
    ]:
        with pytest.raises(InvalidIds, match="window-cached"):
            call(*args)
    with pytest.raises(InvalidIds, match="only the holder"):
        mem.windows.hold(kv.pages[4:5], W, by=object())
    with pytest.raises(InvalidIds, match="already held"):
        mem.windows.hold(parked[:1], W, by=cache.residency)
    checked(cache)
    marks = mem.windows.holds.marks[W]
    marks[kv.pages[5]] = True  # a mark behind the counters' back
    with pytest.raises(AssertionError, match="window-cached cells"):
        mem.verify()
    marks[kv.pages[5]] = False
    kvm.release(kv)
    checked(cache)


def test_pressure_reclaims_window_cached_cells_first_and_never_a_needed_page(cache):
    kvm = KVManager(cache)
    mem = cache.mem
    done = np.arange(1000, 1032)
    first = kvm.admit(kvm.match(done))  # a finished request: the tree keeps its pages
    kvm.extend(first, 32)
    kvm.finish(first, done)
    cached = cache.cached_pages
    kv = kvm.admit(kvm.match(np.arange(48)))  # a running one: 10 of its 12 pages left the window
    kvm.extend(kv, 48)
    kvm.release_windows([kv])
    window_pool = mem.pools[W]
    needed = kv.pages[10:].copy()
    assert cache.residency.window_cache.total == 10
    taken = []
    while cache.residency.window_cache.total:  # fill the memory: window-cached cells go first
        taken.append(kvm.alloc_pages(1))
        if cache.cached_pages != cached or sum(cache.counters.tombstoned.values()):
            assert cache.residency.window_cache.total == 0, "the tree lost a page while window-cached cells were left"
        assert window_pool.resident(needed).all() and mem.pages.live[kv.pages].all()
        checked(cache)
    assert cache.counters.reclaimed[W] == 10
    with pytest.raises(OutOfMemory):  # then the tree's leaves; the running request keeps every page
        while True:
            taken.append(kvm.alloc_pages(1))
    assert cache.cached_pages == 0
    assert window_pool.resident(needed).all() and mem.pages.live[kv.pages].all()
    checked(cache)
    mem.free_pages(np.concatenate(taken))
    toks = np.arange(48)
    kvm.finish(kv, toks)  # the reclaimed pages join the tree tombstoned: no hit inside them
    assert kvm.match(toks).length == 48 and kvm.match(toks[:32]).length == 0
    checked(cache)
    kvm.evict({PAGE_NEED: mem.pages.capacity})
    assert mem.pages.live_count == 0


def test_window_cached_duplicates_lend_their_cells_to_tombstoned_cached_pages(cache):
    toks = np.arange(24)
    eager = KVManager(cache, park_windows=False)
    holder = eager.admit(eager.match(toks))
    eager.extend(holder, 24)
    eager.release_windows([holder])  # pages 0-3 tombstoned in the tree, full KV locked by holder
    eager.insert(holder, toks)
    kvm = KVManager(cache)
    kv = kvm.admit(kvm.match(toks[:16]))
    assert kv.cached == 0 and kv.keep == [(2, 4)]
    kvm.extend(kv, 20)
    fresh = kv.pages.copy()
    assert kvm.release_windows([kv]) == 2  # pages 0-1 window-cached; 2-3 kept for the checkpoint
    result = kvm.insert(kv, toks[:16])
    assert result.adopted_pages == 4 and np.array_equal(result.duplicates, fresh[:4])
    assert not cache.mem.pages.live[fresh[:4]].any() and cache.residency.window_cache.total == 0
    checked(cache)
    assert kvm.match(toks[:16]).length == 16 and kvm.match(toks[:8]).length == 8
    kvm.release(kv)
    eager.release(holder)
    checked(cache)


def test_a_running_request_s_lock_keeps_only_its_window_from_eviction(cache):
    """The insert relocks at the prompt's end; the node is cut where that window starts, so
    the window cells the prompt's pages keep behind it can be tombstoned while it runs."""
    kvm = KVManager(cache)
    toks = np.arange(48)
    kv = kvm.admit(kvm.match(toks))
    kvm.extend(kv, 48)
    kvm.release_windows([kv])
    kvm.insert(kv, toks)  # the tree takes all 12 pages, window cells resident; the request runs on
    assert [(n.start, n.end, n.window_lock) for n in kv.lock.node.path()] == [(0, 40, 0), (40, 48, 1)]
    assert cache.evict({W: 100}) == {W: 10}
    assert cache.match_prefix(toks).length == 48 and cache.match_prefix(toks[:40]).length == 0
    checked(cache)
    kvm.release(kv)
    checked(cache)


def test_a_full_pool_short_with_every_leaf_locked_takes_window_cells_behind_the_locks(cache):
    """Nothing unlocked but the window cells a running request's prompt keeps behind its
    window: an allocator short of full-KV cells (``for_slabs``) gets their bytes, tombstoned
    (its broker compacts them into slabs); a plain eviction for full KV takes nothing."""
    kvm = KVManager(cache)
    toks = np.arange(48)
    kv = kvm.admit(kvm.match(toks))
    kvm.extend(kv, 48)
    kvm.release_windows([kv])
    kvm.insert(kv, toks)
    full = cache.rules.full.pools[0]
    assert cache.evict({full: 1}) == {}
    assert cache.evict({full: 1}, for_slabs=True) == {W: 10}
    assert cache.cached_pages == 12 and cache.mem.pages.live[kv.pages].all()
    assert cache.match_prefix(toks).length == 48 and cache.match_prefix(toks[:40]).length == 0
    checked(cache)
    kvm.release(kv)
    checked(cache)


def test_an_allocator_short_of_window_cells_gets_the_tree_s_after_the_window_cached_ones(cache):
    """The window cache alone cannot cover a window pool's own shortfall: the rest comes from the
    tree (here the unlocked finished leaf, whole), never from the running request."""
    kvm = KVManager(cache)
    done = kvm.admit(kvm.match(np.arange(40)))
    kvm.extend(done, 40)
    kvm.release_windows([done])
    kvm.finish(done, np.arange(40))  # the tree holds its window cells, nothing locks them
    running = kvm.admit(kvm.match(np.arange(100, 124)))
    kvm.extend(running, 24)
    assert kvm.release_windows([running]) == 4  # four window-cached cells
    freed = cache.evict({W: 8}, for_slabs=True)
    assert freed[W] == 4 + 10 and cache.cached_pages == 0  # the window cache, then the leaf's 10 cells
    assert cache.residency.window_cache.total == 0 and cache.mem.pages.live[running.pages].all()
    checked(cache)
    kvm.release(running)
    checked(cache)
