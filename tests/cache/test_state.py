"""Recurrent-state rules: checkpoints at node ends, hits cut back to the deepest checkpoint,
copy-on-write forks on real tensors, the per-path cap, state locks on their node only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.cache import HybridRadixCache, KVManager
from hybridkv.spec import RECURRENT_POOL
from tests.cache.helpers import small_memory

PS = 4


@pytest.fixture
def cache() -> HybridRadixCache:
    return HybridRadixCache(small_memory("tiny-gdn", PS, budget=400_000))


def put(cache: HybridRadixCache, tokens: np.ndarray, at: list[int]):
    """Insert ``tokens`` with checkpoints at ``at`` (the caller-side of an insert, by hand):
    returns the result and the slots given; frees what the cache did not keep."""
    m = cache.match_prefix(tokens)
    lock = cache.lock(m.node)
    kvm = KVManager(cache)
    row = np.concatenate([m.pages, kvm.alloc_pages(tokens.size // PS - m.pages.size)])
    states = {pos: int(kvm.alloc_state(1)[0]) for pos in at}
    result = cache.insert(tokens, row, checkpoints=states)
    cache.mem.free_state(result.unused_checkpoints)
    cache.mem.free_pages(result.duplicates)
    cache.unlock(lock)
    cache.check()
    cache.mem.verify()
    return result, states


def test_hit_is_cut_back_to_the_deepest_checkpoint(cache):
    toks = np.arange(24)
    _, states = put(cache, toks, at=[8, 24])
    m = cache.match_prefix(toks)
    assert (m.length, m.checkpoint) == (24, states[24])
    m = cache.match_prefix(toks[:20])
    assert (m.length, m.full_length, m.checkpoint_length, m.checkpoint) == (8, 20, 8, states[8])
    assert m.checkpoint_at == 20 and m.node.end == 8
    assert cache.match_prefix(toks[:6]).length == 0 and cache.match_prefix(toks[:6]).checkpoint is None


def test_fork_copies_the_checkpoint_and_leaves_it_untouched(cache):
    toks = np.arange(16)
    _, states = put(cache, toks, at=[16])
    mem = cache.mem
    layer = mem.pools[RECURRENT_POOL].layout.layer_ids[0]
    view = mem.view(layer, "recurrent_state")
    state_pool = RECURRENT_POOL
    ckpt = mem.page_cells([states[16]], state_pool)
    view[ckpt] = torch.randn_like(view[ckpt])
    before = view[ckpt].clone()
    kvm = KVManager(cache)
    m = kvm.match(toks)
    kv = kvm.admit(m)  # forks the hit's checkpoint into the request's running state slot
    fork = kv.state_slot
    mine = mem.page_cells([fork], state_pool)
    assert fork != m.checkpoint and torch.equal(view[mine], before)
    view[mine] += 1.0  # the request advances its own copy
    assert torch.equal(view[ckpt], before)
    kvm.extend(kv, 20)
    view[mine] += 1.0
    kvm.extend(kv, 24)
    copy = kvm.checkpoints.take(kv)  # a checkpoint copies the running state at 24 tokens
    copied = view[mem.page_cells([copy], state_pool)]
    assert torch.equal(copied, view[mine]) and not torch.equal(copied, before)
    kvm.finish(kv, np.arange(24))
    assert cache.match_prefix(np.arange(24)).checkpoint == copy
    assert torch.equal(view[ckpt], before) and not mem.slots.live[fork]
    cache.check()
    mem.verify()


def test_cap_on_checkpoints_per_path():
    cache = HybridRadixCache(small_memory("tiny-gdn", PS, budget=400_000), max_checkpoints_per_path=2)
    toks = np.arange(32)
    live = cache.mem.slots.live_count
    result, _ = put(cache, toks, at=[8, 16, 24])
    assert result.unused_checkpoints == [] and cache.num_checkpoints == 2  # 8 dropped for 24
    assert cache.mem.slots.live_count == live + 2
    assert cache.match_prefix(toks[:12]).length == 0
    assert cache.match_prefix(toks[:20]).length == 16
    # a deeper checkpoint drops the least valuable one above it (non-branching, least recent)
    put(cache, toks, at=[32])
    assert cache.num_checkpoints == 2 and cache.match_prefix(toks).length == 32
    assert cache.match_prefix(toks[:20]).length == 0  # 16 went; 24 and 32 stay
    # one above a full path below it has nothing above it to drop: refused, its slot freed
    result, given = put(cache, toks, at=[8])
    assert result.unused_checkpoints == [given[8]] and cache.num_checkpoints == 2
    assert not cache.mem.slots.live[given[8]]
    cache.check()


def test_state_lock_protects_only_its_node(cache):
    toks = np.arange(24)
    _, states = put(cache, toks, at=[8, 16, 24])
    m = cache.match_prefix(toks[:16])
    lock = cache.lock(m.node)
    state = cache.rules.checkpoint.pool_id
    assert [n.checkpoint_lock for n in m.node.path()] == [0, 1]
    assert cache.evict({state: 3}) == {state: 2}  # 8 and 24 go; 16 is locked
    assert m.node.checkpoint == states[16]
    assert cache.match_prefix(toks).length == 16
    cache.unlock(lock)
    assert cache.evict({state: 3}) == {state: 1}
    assert cache.match_prefix(toks).length == 0 and cache.cached_tokens == 24  # full KV stays
    cache.check()
    cache.mem.verify()


def test_duplicate_checkpoint_is_freed(cache):
    toks = np.arange(16)
    put(cache, toks, at=[16])
    live = cache.mem.slots.live_count
    kvm = KVManager(cache)
    kv = kvm.admit(kvm.match(toks[:0]))  # a request that computes the same 16 tokens itself
    kvm.extend(kv, 16)
    own = kv.own_pages().copy()
    slot = kvm.checkpoints.reserve(kv, 16)
    result = kvm.insert(kv, toks)
    assert result.unused_checkpoints == [slot] and np.array_equal(result.duplicates, own)
    assert not cache.mem.slots.live[slot] and not cache.mem.pages.live[own].any()  # the manager freed them
    kvm.release(kv)
    assert cache.mem.slots.live_count == live
    cache.check()


def test_checkpoint_above_another_keeps_cost_keys_consistent():
    """With the cost policy a state's key counts the recompute back to the previous checkpoint;
    a new checkpoint above it lowers that key, so the state must stay evictable in order."""
    cache = HybridRadixCache(small_memory("tiny-gdn", PS, budget=400_000), policy="cost")
    toks = np.arange(24)
    _, deep = put(cache, toks, at=[24])
    put(cache, toks[:8], at=[8])  # does not touch the node ending at 24
    cache.check()  # every checkpoint has a heap entry at or below its current key
    state = cache.rules.checkpoint.pool_id
    assert cache.evict({state: 1}) == {state: 1}
    # per byte, the checkpoint at 8 saves 8 tokens, the one at 24 the 16 tokens since 8
    assert cache.match_prefix(toks[:8]).length == 0
    assert cache.match_prefix(toks).checkpoint == deep[24]


def test_each_node_counts_the_checkpoints_below_it(cache):
    """The cap reads ``checkpoints_below`` instead of walking the subtree: kept through
    attaches, splits (a checkpoint inside a node) and evictions, and the check recounts it."""
    base = np.arange(32)
    put(cache, base, at=[8, 32])
    put(cache, np.concatenate([base[:16], 100 + np.arange(16)]), at=[16, 24, 32])  # splits at 16
    put(cache, base, at=[24])  # a checkpoint inside the first path: splits there
    path = cache.match_prefix(base).node.path()
    assert [n.end for n in path] == [8, 16, 24, 32]
    assert [n.checkpoints_below for n in path] == [3, 2, 1, 0]  # via the branch: 16, 24, 32
    state = cache.rules.checkpoint.pool_id
    while cache.num_checkpoints:
        cache.evict({state: 1})
        cache.check()  # recounts every node bottom-up
    assert all(n.checkpoints_below == 0 and not n.below_counts for _, n in cache.tree.nodes())
    path[0].checkpoints_below = 5
    with pytest.raises(AssertionError, match="deepest path below, counted 5"):
        cache.check()
