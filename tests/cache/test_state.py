"""Recurrent-state rules: checkpoints at node ends, hits cut back to the deepest checkpoint,
copy-on-write forks on real tensors, the per-path cap, state locks on their node only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.cache import HybridRadixCache
from hybridkv.spec import RECURRENT_POOL
from tests.cache.helpers import small_memory

PS = 4


@pytest.fixture
def cache() -> HybridRadixCache:
    return HybridRadixCache(small_memory("tiny-gdn", PS, budget=400_000))


def put(cache: HybridRadixCache, tokens: np.ndarray, at: list[int]):
    m = cache.match_prefix(tokens)
    lock = cache.lock(m.node)
    row = np.concatenate([m.pages, cache.alloc_pages(tokens.size // PS - m.pages.size)])
    states = {pos: int(cache.alloc_state(1)[0]) for pos in at}
    result = cache.insert(tokens, row, states=states)
    cache.unlock(lock)
    cache.check()
    cache.mem.verify()
    return result, states


def test_hit_is_cut_back_to_the_deepest_checkpoint(cache):
    toks = np.arange(24)
    _, states = put(cache, toks, at=[8, 24])
    m = cache.match_prefix(toks)
    assert (m.length, m.state) == (24, states[24])
    m = cache.match_prefix(toks[:20])
    assert (m.length, m.full_length, m.state_length, m.state) == (8, 20, 8, states[8])
    assert m.checkpoint_at == 20 and m.node.end == 8
    assert cache.match_prefix(toks[:6]).length == 0 and cache.match_prefix(toks[:6]).state is None


def test_fork_copies_the_checkpoint_and_leaves_it_untouched(cache):
    toks = np.arange(16)
    _, states = put(cache, toks, at=[16])
    mem = cache.mem
    layer = mem.pools[RECURRENT_POOL].layout.layer_ids[0]
    view = mem.view(layer, "recurrent_state")
    ckpt = mem.page_cells([states[16]], RECURRENT_POOL)
    view[ckpt] = torch.randn_like(view[ckpt])
    before = view[ckpt].clone()
    m = cache.match_prefix(toks)
    lock = cache.lock(m.node)
    (fork,) = cache.fork_state([m.state])
    mine = mem.page_cells([fork], RECURRENT_POOL)
    assert fork != m.state and torch.equal(view[mine], before)
    view[mine] += 1.0  # the request advances its own copy
    assert torch.equal(view[ckpt], before)
    mem.free_state([fork])
    cache.unlock(lock)
    cache.check()


def test_cap_on_checkpoints_per_path():
    cache = HybridRadixCache(small_memory("tiny-gdn", PS, budget=400_000), max_states_per_path=2)
    toks = np.arange(32)
    live = cache.mem.slots.live_count
    result, _ = put(cache, toks, at=[8, 16, 24])
    assert result.freed_states == 0 and cache.num_states == 2  # 8 dropped for 24
    assert cache.mem.slots.live_count == live + 2
    assert cache.match_prefix(toks[:12]).length == 0
    assert cache.match_prefix(toks[:20]).length == 16
    # a deeper checkpoint drops the least valuable one above it (non-branching, least recent)
    put(cache, toks, at=[32])
    assert cache.num_states == 2 and cache.match_prefix(toks).length == 32
    assert cache.match_prefix(toks[:20]).length == 0  # 16 went; 24 and 32 stay
    # one above a full path below it has nothing above it to drop: refused, its slot freed
    result, _ = put(cache, toks, at=[8])
    assert result.freed_states == 1 and cache.num_states == 2
    cache.check()


def test_state_lock_protects_only_its_node(cache):
    toks = np.arange(24)
    _, states = put(cache, toks, at=[8, 16, 24])
    m = cache.match_prefix(toks[:16])
    lock = cache.lock(m.node)
    assert [n.state_lock for n in m.node.path()] == [0, 1]
    assert cache.evict({RECURRENT_POOL: 3}) == {RECURRENT_POOL: 2}  # 8 and 24 go; 16 is locked
    assert m.node.state == states[16]
    assert cache.match_prefix(toks).length == 16
    cache.unlock(lock)
    assert cache.evict({RECURRENT_POOL: 3}) == {RECURRENT_POOL: 1}
    assert cache.match_prefix(toks).length == 0 and cache.cached_tokens == 24  # full KV stays
    cache.check()
    cache.mem.verify()


def test_duplicate_checkpoint_is_freed(cache):
    toks = np.arange(16)
    put(cache, toks, at=[16])
    live = cache.mem.slots.live_count
    own = cache.alloc_pages(4)
    slot = int(cache.alloc_state(1)[0])
    result = cache.insert(toks, own, states={16: slot})
    assert result.freed_states == 1 and result.freed_pages == 4
    assert cache.mem.slots.live_count == live and not cache.mem.slots.live[slot]
    cache.check()


def test_checkpoint_above_another_keeps_cost_keys_consistent():
    """With the cost policy a state's key counts the recompute back to the previous checkpoint;
    a new checkpoint above it lowers that key, so the state must stay evictable in order."""
    cache = HybridRadixCache(small_memory("tiny-gdn", PS, budget=400_000), policy="cost")
    toks = np.arange(24)
    _, deep = put(cache, toks, at=[24])
    put(cache, toks[:8], at=[8])  # does not touch the node ending at 24
    cache.check()  # every checkpoint has a heap entry at or below its current key
    assert cache.evict({RECURRENT_POOL: 1}) == {RECURRENT_POOL: 1}
    # per byte, the checkpoint at 8 saves 8 tokens, the one at 24 the 16 tokens since 8
    assert cache.match_prefix(toks[:8]).length == 0
    assert cache.match_prefix(toks).state == deep[24]
