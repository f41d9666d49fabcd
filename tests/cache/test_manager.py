"""KVManager: allocation that evicts only what is needed and refuses only what an empty cache
could not give; batched growth; token locations; pins that hold a request's ids."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED, CacheError, HybridRadixCache, KVManager
from hybridkv.cache.handle import HandleStatus
from hybridkv.memory import GateStatus, OutOfMemory, PinnedError
from tests.cache.helpers import FLOORS, small_memory

PS = 4


def served(kvm: KVManager, base: int, n: int = 16) -> None:
    """One request of ``n`` fresh tokens, inserted and released: the cache keeps its pages."""
    toks = base * 1000 + np.arange(n)
    kv = kvm.admit(kvm.match(toks))
    kvm.extend(kv, n)
    kvm.finish(kv, toks)


def test_allocation_evicts_until_it_fits_and_refuses_only_beyond_an_empty_cache():
    kvm = KVManager(HybridRadixCache(small_memory("tiny-dense", PS)))
    mem, cache = kvm.mem, kvm.cache
    bases = 0
    while mem.available_pages() >= 4:
        bases += 1
        served(kvm, bases)
    assert cache.cached_pages == 4 * bases and bases > 2
    held = kvm.alloc_pages(6)  # more than is free: evicts least recently used leaves, no more than needed
    assert 0 < cache.counters.evicted_pages < 4 * bases
    mem.free_pages(held)
    with pytest.raises(OutOfMemory):
        kvm.alloc_pages(mem.pages.capacity)  # even an empty cache could not give it
    assert cache.cached_pages == 0, "the refusal came only once everything evictable was gone"
    mem.verify()
    cache.check()
    assert mem.pages.live_count == 0


def test_a_refused_batch_changes_no_request():
    kvm = KVManager(HybridRadixCache(small_memory("tiny-swa2-state", PS)))
    a, b = (kvm.admit(kvm.match(np.arange(k, k + 8))) for k in (0, 100))
    kvm.extend_batch([a, b], [8, 12])
    assert (a.n_pages, b.n_pages, a.seq_len, b.seq_len) == (2, 3, 8, 12)
    before = (a.pages.copy(), b.pages.copy(), kvm.mem.pages.live_count)
    with pytest.raises(OutOfMemory):
        kvm.extend_batch([a, b], [8, 10**6])
    assert np.array_equal(a.pages, before[0]) and np.array_equal(b.pages, before[1])
    assert (a.seq_len, b.seq_len, kvm.mem.pages.live_count) == (8, 12, before[2])
    with pytest.raises(CacheError, match="cannot shrink"):
        kvm.extend_batch([a, b], [12, 4])
    assert (a.seq_len, a.n_pages) == (8, 2), "a refused batch grew none of its requests"
    for kv in (a, b):
        kvm.release(kv)
    assert kvm.mem.pages.live_count == 0 and kvm.mem.slots.live_count == 0


def test_token_locations_follow_the_row():
    kvm = KVManager(HybridRadixCache(small_memory("tiny-dense", PS)))
    served(kvm, 1, 8)
    toks = np.concatenate([1000 + np.arange(8), np.arange(5)])
    kv = kvm.admit(kvm.match(toks))
    assert kv.cached == 2 and kv.state_from_zero
    kvm.extend(kv, 13)
    locs = kv.token_locs()
    assert locs.size == 13 and np.array_equal(locs // PS, np.repeat(kv.pages, PS)[:13])
    assert np.array_equal(locs % PS, np.arange(13) % PS)
    assert np.array_equal(kv.token_locs(8, 13), locs[8:])
    with pytest.raises(CacheError, match="within the request's 13 tokens"):
        kv.token_locs(0, 14)
    kvm.release(kv)


def test_a_pinned_request_keeps_its_ids_until_unpinned():
    kvm = KVManager(HybridRadixCache(small_memory("tiny-swa2-state", PS)))
    toks = np.arange(16)
    kv = kvm.admit(kvm.match(toks))
    kvm.extend(kv, 16)
    kvm.insert(kv, toks)  # the cache holds the pages now, this request locks them
    gate = kvm.pin(kv)
    assert kvm.mem.gates.page_pins[kv.pages].all() and kvm.mem.gates.slot_pins[kv.state_slot]
    with pytest.raises(CacheError, match="unpin it first"):
        kvm.release(kv)
    with pytest.raises(PinnedError):
        kvm.mem.free_state([kv.state_slot])
    kvm.unpin(kv)
    assert gate.status is GateStatus.RELEASED and not kvm.mem.gates.page_pins[kv.pages].any()
    kvm.release(kv)
    kvm.cache.check()
    kvm.mem.verify()


def test_a_reserved_handle_is_unreadable_until_received_then_runs_and_caches():
    """KV that arrives by transfer lands in a RECEIVING handle: nothing reads, grows, inserts or pins it
    until ``received``; then it continues like any request. A refused reservation holds nothing."""
    kvm = KVManager(HybridRadixCache(small_memory("tiny-gdn", PS)))
    mem, cache = kvm.mem, kvm.cache
    h = kvm.reserve(10)
    assert h.status is HandleStatus.RECEIVING and h.seq_len == 10 and h.pages.size == 3
    assert h.state_slot is not None and not h.state_from_zero
    for bad in (
        lambda: h.token_locs(),
        lambda: kvm.extend(h, 14),
        lambda: kvm.insert(h, np.arange(10)),
        lambda: kvm.pin(h),
        lambda: kvm.checkpoints.take(h),
    ):
        with pytest.raises(CacheError):
            bad()
    assert kvm.match(np.arange(10)).length == 0  # not in the tree: nothing can hit it
    kvm.evict({PAGE_NEED: mem.pages.capacity})  # nor evict it
    assert mem.pages.live_count == 3 and mem.slots.live_count == 1
    running = kvm.admit(kvm.match(np.arange(4)))
    with pytest.raises(CacheError, match="not receiving"):
        kvm.received(running)
    kvm.release(running)
    kvm.received(h)
    kvm.extend(h, 14)  # it continues like any request
    toks = np.arange(14)
    kvm.finish(h, toks)
    assert kvm.match(toks).full_length == 12  # its pages were cached on finish
    kvm.evict({PAGE_NEED: mem.pages.capacity})
    assert mem.pages.live_count == 0 and mem.slots.live_count == 0
    live = (mem.pages.live_count, mem.slots.live_count)
    with pytest.raises(OutOfMemory):
        kvm.reserve(mem.pages.capacity * PS + 1)
    assert (mem.pages.live_count, mem.slots.live_count) == live and cache.open_locks == 0
    dropped = kvm.reserve(20)  # a transfer that failed: released through the one free path
    kvm.release(dropped)
    assert mem.pages.live_count == 0 and mem.slots.live_count == 0
    mem.verify()
    cache.check()


def test_a_lone_request_gives_up_its_own_checkpoints_before_its_pages():
    """At the feasibility floor a request that reserved a checkpoint at every page (the
    replay's way) still grows to the full context: its reserved checkpoints are freed, and
    counted, once nothing else is left to evict; a refusal of more than the budget gives
    up the same (an optimisation) and changes nothing else."""
    kvm = KVManager(HybridRadixCache(small_memory("tiny-gdn", PS, FLOORS["tiny-gdn"])), "interval:4")
    mem, cache = kvm.mem, kvm.cache
    served(kvm, 1, 40)  # the cache holds pages and checkpoints too
    toks = np.arange(64)
    kv = kvm.admit(kvm.match(toks[:-1]))
    for at in kvm.checkpoints.wanted(kv, 64):
        try:
            kvm.checkpoints.reserve(kv, at)
        except OutOfMemory:
            break
    reserved = len(kv.checkpoints)
    assert reserved >= 2
    kvm.extend(kv, 64)
    given_up = cache.counters.given_up_checkpoints
    assert 0 < given_up <= reserved and len(kv.checkpoints) == reserved - given_up
    assert cache.stats()["given_up_states"] == given_up
    assert mem.slots.live_count == 1 + len(kv.checkpoints) + cache.num_checkpoints
    mem.verify()
    cache.check()
    with pytest.raises(OutOfMemory):
        kvm.extend(kv, 10**6)
    assert kv.seq_len == 64 and not kv.checkpoints
    kvm.finish(kv, toks)
    kvm.evict({PAGE_NEED: mem.pages.capacity})
    assert mem.pages.live_count == 0 and mem.slots.live_count == 0


def test_a_running_request_short_of_memory_lets_go_of_its_hit_s_checkpoint():
    """At the floor a state slot is a whole slab and the hit's pages fill the rest: a request that
    hits a checkpoint has no room to fork it, so it runs on the checkpoint itself (out of the
    cache). A request that can fork keeps the hit's checkpoint locked (safe from eviction and
    the path cap) until its own pages are refused: then it lets go and the cache evicts it."""
    kvm = KVManager(HybridRadixCache(small_memory("tiny-kda-mla", PS, FLOORS["tiny-kda-mla"])), "end")
    mem, cache = kvm.mem, kvm.cache
    state = cache.rules.checkpoint.pool_id
    toks = 1000 + np.arange(64)
    slot = int(mem.alloc_state(1)[0])  # the cache holds 32 tokens and their checkpoint: one slab each
    cache.insert(toks[:32], mem.alloc_pages(8), checkpoints={32: slot})
    kv = kvm.admit(kvm.match(toks[:-1]))  # no room for a copy: the checkpoint becomes its state
    assert kv.cached == 8 and not kv.state_from_zero and kv.state_slot == slot
    assert cache.num_checkpoints == 0 and kv.lock.checkpoint_node is None
    kvm.extend(kv, 64)
    kvm.finish(kv, toks[:60])
    cache.check()
    mem.verify()

    kvm = KVManager(HybridRadixCache(small_memory("tiny-gdn", PS, FLOORS["tiny-gdn"])), "end")
    mem, cache = kvm.mem, kvm.cache
    state = cache.rules.checkpoint.pool_id
    first = kvm.admit(kvm.match(toks[:32]))
    kvm.extend(first, 32)
    slot = kvm.checkpoints.reserve(first, kvm.checkpoints.at_finish(first))
    kvm.finish(first, toks[:32])
    kv = kvm.admit(kvm.match(toks[:-1]))  # a spare slab: room for the fork
    assert kv.cached == 8 and kv.state_slot != slot and kv.lock.node.checkpoint_lock == 1
    assert cache.evict({state: 1}) == {}, "a running request's lock keeps its hit's checkpoint"
    kvm.extend(kv, 48)
    other = mem.alloc_pages(mem.available_pages())  # someone else takes what is left
    kvm.extend(kv, 64)  # its own pages need the checkpoint's slab now
    assert kv.lock.checkpoint_node is None and cache.num_checkpoints == 0
    assert cache.counters.evicted_checkpoints == 1 and kvm.match(toks[:32]).full_length == 32
    cache.check()
    mem.verify()
    mem.free_pages(other)
    kvm.finish(kv, toks)
    kvm.evict({PAGE_NEED: mem.pages.capacity})
    assert mem.pages.live_count == 0 and mem.slots.live_count == 0
