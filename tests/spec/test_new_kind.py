"""Adding a layer kind in one place: chunked-local attention, defined only in this module.

Token ``p`` attends to ``[p // C * C, p]``, so the token at ``L - 1`` reads, and a
continuation at length ``L`` needs resident, the tokens ``[(L - 1) // C * C, L)`` (the pool
id's ``first_needed(L)``, one statement for memory and the engine's attention). The kind and
its pool id below follow the checklist in ``hybridkv.spec``; nothing in spec, memory or the
planner knows about them, yet memory builds its own pool, sizing and capacity account for
it, views address it, release outside the span frees exactly the pages no continuation can
read, a transfer plan sends exactly the pages the span needs, and a prefix-cache hit is
valid exactly when the pages of its span are resident (the cache's window rule asks the pool
id).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

from hybridkv.cache import HybridRadixCache, KVManager
from hybridkv.memory import LayoutError, MemoryHints, TokenAllocator, UnifiedMemory, plan_memory
from hybridkv.memory.capacity import fit_requests
from hybridkv.spec import (
    FULL_POOL,
    FullAttention,
    IdSpace,
    KVHeads,
    ModelSpec,
    Parallel,
    PoolId,
    PoolIdError,
    Positions,
    ShardSpec,
    SlidingWindow,
    WindowPool,
)
from hybridkv.transfer import buffer_set_from_memory, build_plan, memory_cells, pair_entries


@dataclass(frozen=True)
class ChunkPool(PoolId):
    """Pages of chunked-local layers with chunk ``chunk``: ``[(L - 1) // chunk * chunk, L)``."""

    chunk: int
    family: ClassVar[str] = "test-chunk"  # a test's family: never a product one
    id_space: ClassVar[IdSpace] = IdSpace.PAGE
    rank: ClassVar[int] = 2

    @property
    def param(self) -> int | None:
        return self.chunk

    @classmethod
    def from_param(cls, param: int | None) -> PoolId:
        assert param is not None
        return cls(param)

    def first_needed(self, seq_len: Positions) -> Positions:
        return (seq_len - 1) * (seq_len > 0) // self.chunk * self.chunk

    @property
    def max_span(self) -> int | None:
        return self.chunk  # at L = k * chunk: the whole chunk the token at L - 1 reads


@dataclass(frozen=True)
class ChunkedLocal(KVHeads):
    """Attention within fixed chunks of ``chunk`` tokens (K and V per head, like SWA)."""

    chunk: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    tag: ClassVar[str] = "chunked_local"

    @property
    def pool_id(self) -> PoolId | None:
        return ChunkPool(self.chunk)


@dataclass(frozen=True)
class WrongChunkPool(ChunkPool):
    """The chunk rule read as "what the token at ``L`` reads", ``L // chunk * chunk``: at ``L = chunk``
    the token at ``chunk - 1`` would read no key at all (served, the engine's ``index_copy_(): index -1``)."""

    def first_needed(self, seq_len: Positions) -> Positions:
        return seq_len // self.chunk * self.chunk


@dataclass(frozen=True)
class WrongChunkedLocal(ChunkedLocal):
    @property
    def pool_id(self) -> PoolId | None:
        return WrongChunkPool(self.chunk)


C = 8
PS = 4


def model(chunk: int = C) -> ModelSpec:
    local = ChunkedLocal(chunk, 4, 8, 8)
    layers = [local, FullAttention(2, 8, 8), SlidingWindow(8, 2, 8, 8), local]
    return ModelSpec.from_kinds("tiny-chunked", layers, kv_dtype=torch.float32, max_context=64)


def make(chunk: int = C) -> UnifiedMemory:
    return UnifiedMemory.create(ShardSpec.whole(model(chunk)), 300_000, page_size=PS, max_context=64, chunk_tokens=16)


def needed_positions(seq_len: int, chunk: int = C) -> set[int]:
    """From the attention pattern itself: what the token at ``seq_len - 1`` reads."""
    return {q for q in range(seq_len) if q // chunk == (seq_len - 1) // chunk}


def test_the_pool_id_is_typed_and_reads_back_from_its_display_form():
    pool = ChunkPool(C)
    assert str(pool) == "test-chunk:8" and PoolId.parse("test-chunk:8") == pool
    assert pool != "test-chunk:8" and pool != WindowPool(8)
    assert pool.releases_history and not pool.keeps_history
    for seq_len in range(40):
        assert set(range(*pool.span(seq_len))) == needed_positions(seq_len)
    lens = np.arange(40)
    assert np.array_equal(pool.first_needed(lens), [pool.first_needed(int(n)) for n in lens])


def test_a_rule_that_leaves_a_token_unread_by_itself_is_refused_when_the_spec_is_built():
    ModelSpec.from_kinds("right", [ChunkedLocal(C, 4, 8, 8)], max_context=64)
    with pytest.raises(PoolIdError, match=r"first_needed\(L\) <= L - 1 for L >= 1 .*first_needed\(8\) is 8"):
        ModelSpec.from_kinds("wrong", [WrongChunkedLocal(C, 4, 8, 8)], max_context=64)


def test_memory_builds_its_own_pool_and_views_address_it():
    mem = make()
    assert set(mem.pools) == {FULL_POOL, WindowPool(8), ChunkPool(C)}
    layout = mem.layout(ChunkPool(C))
    assert layout.layer_ids == [0, 3] and layout.page_size == PS
    assert {(s.layer_id, s.tensor, s.shape, s.tp_dim) for s in layout.segments} == {
        (lid, t, (PS, 4, 8), 1) for lid in (0, 3) for t in ("k", "v")
    }
    assert mem.pools[ChunkPool(C)] in mem.window_pools and mem.pool_of_layer(3).pool_id == ChunkPool(C)
    assert mem.geometry(0)["pool"] == ChunkPool(C)

    page = mem.alloc_pages(1)
    cell = int(mem.page_cells(page, ChunkPool(C))[0])
    mem.view(3, "v")[cell] = torch.arange(PS * 4 * 8, dtype=torch.float32).view(PS, 4, 8)
    seg = layout.segment(3, "v")
    raw = mem.arena.buffer[cell * layout.cell_bytes + seg.offset :][: seg.nbytes]
    assert torch.equal(raw.view(torch.float32), torch.arange(PS * 4 * 8, dtype=torch.float32))
    mem.verify()


def test_sizing_and_capacity_account_for_it():
    plan = plan_memory(ShardSpec.whole(model()), 300_000, MemoryHints(page_size=PS, max_context=64, chunk_tokens=16))
    layout = next(lay for lay in plan.layouts if lay.pool_id == ChunkPool(C))
    assert layout.cell_bytes == 2 * 2 * PS * 4 * 8 * 4  # 2 layers, K+V, page, heads, dim, float32
    # a span of at most C tokens plus a 16-token prefill chunk in flight
    assert plan.worst_case_cells()[ChunkPool(C)] == math.ceil((C + 16) / PS) + 1
    assert layout.cells_per_request(64) == math.ceil(C / PS) + 1
    fit = fit_requests(plan, 64)
    assert fit.bytes_per_request == sum(lay.cells_per_request(64) * lay.cell_bytes for lay in plan.layouts)
    assert ChunkPool(C) in fit.static_split
    with pytest.raises(LayoutError, match="test-chunk:8"):
        plan_memory(ShardSpec.whole(model()), 20_000, MemoryHints(page_size=PS, max_context=64, chunk_tokens=16))


def test_tp_shards_it_like_any_per_head_attention():
    shard = ShardSpec(model(), Parallel(tp_size=2), 0, 1)
    assert shard.local_kind(0) == ChunkedLocal(C, 2, 8, 8) and shard.kv_head_range(0) == (2, 4)
    assert model().kv_bytes_per_token("chunked_local") == 2 * 4 * 16 * 4
    assert ChunkedLocal(C, 4, 8, 8).recompute_flops_per_token(21) == 2 * 4 * 16 * (21 % C + 1)


@pytest.mark.parametrize("size", [C, 6])  # chunks aligned to pages, and not
def test_release_outside_the_span_frees_exactly_the_pages_no_continuation_reads(size):
    mem = make(size)
    row = TokenAllocator(mem).alloc(30)
    pages = row[::PS] // PS
    chunk, window = ChunkPool(size), WindowPool(8)
    for seq_len in (5, 16, 18, 21, 24, 30):
        mem.windows.free_outside_span(pages, seq_len)
        mem.verify()
        keep = {q // PS for q in needed_positions(seq_len, size)}
        # pages from the span start on stay, and the page the next token writes (position seq_len)
        first_kept = min(keep) if keep else seq_len // PS
        expect = np.arange(pages.size) >= first_kept
        assert np.array_equal(mem.resident(pages, chunk), expect), seq_len
        assert np.array_equal(mem.resident(pages, window), np.arange(pages.size) >= max(0, seq_len - 8) // PS)
        assert mem.resident(pages, FULL_POOL).all()
    TokenAllocator(mem).free(row)  # the rest goes with the row
    mem.verify()
    assert mem.pools[chunk].live_count == mem.pools[window].live_count == mem.pools[FULL_POOL].live_count == 0


@pytest.mark.parametrize("size", [C, 6])
def test_a_transfer_sends_exactly_the_pages_its_span_needs(size):
    """Transfer knows nothing of chunks: the plan asks the pool id's rule, so a prefill that
    released everything outside the span still has every page the plan reads, and decode
    receives exactly the pages the attention pattern reads (plus the page the next token
    writes), in every pool."""
    pre, dec = make(size), make(size)
    base = 1 << 40
    pre_bufs, dec_bufs = buffer_set_from_memory(pre, base), buffer_set_from_memory(dec, 2 * base)
    pairs = pair_entries(pre_bufs, dec_bufs)
    pages, dpages = pre.alloc_pages(8), dec.alloc_pages(8)
    chunk = ChunkPool(size)
    for seq_len in (5, 12, 16, 18, 21, 24, 30, 32):
        pre.windows.free_outside_span(pages, seq_len)  # what a prefill engine releases as it runs
        dst = memory_cells(dec, dpages, None)
        plan = build_plan(pre_bufs, dec_bufs, pairs, seq_len, memory_cells(pre, pages, None), dst)
        written = np.zeros(dec.arena.nbytes, dtype=bool)
        for a, n in zip((plan.dst - 2 * base).tolist(), plan.length.tolist(), strict=True):
            written[a : a + n] = True
        n_pages = -(-seq_len // PS)
        chunk_pages = {q // PS for q in needed_positions(seq_len, size)} | ({seq_len // PS} if seq_len % PS else set())
        wants = {
            chunk: chunk_pages,
            WindowPool(8): set(range(max(0, seq_len - 8) // PS, n_pages)),
            FULL_POOL: set(range(n_pages)),
        }
        for pool_id, want in wants.items():
            pool = dec.pools[pool_id]
            spans = [(c * pool.cell_bytes, c * pool.cell_bytes + pool.layout.data_bytes) for c in dst[str(pool_id)]]
            assert all(written[a:b].all() or not written[a:b].any() for a, b in spans)  # whole cells
            sent = {i for i, (a, b) in enumerate(spans) if written[a:b].any()}
            assert sent == want, (str(pool_id), seq_len)
        assert plan.nbytes == sum(len(w) * dec.pools[p].layout.data_bytes for p, w in wants.items())


def test_a_cache_hit_needs_the_chunk_span_before_its_end_resident():
    """The prefix cache knows nothing of chunks: a hit ending at ``E`` is valid exactly when
    the pages holding what the token at ``E - 1`` reads (``needed_positions``) are resident in
    the chunk pool (and ``[E - 8, E)`` in the window pool). With the chunk pages of the
    shared prefix ``[0, 12)`` evicted, hits at 12 and at 16 are refused (the token at 15
    reads ``[0, 16)``) while a hit at 20 reads only ``[16, 20)`` of the next chunk and stands."""
    chunk = ChunkPool(16)
    mem = make(16)
    cache = HybridRadixCache(mem)
    kvm = KVManager(cache)
    a = np.arange(1, 33, dtype=np.int64)
    b = np.concatenate([a[:12], a[12:] + 1000])
    rows = []
    for toks in (a, b):
        h = kvm.admit(kvm.match(toks))
        kvm.extend(h, toks.size)
        rows.append(h.pages.copy())
        kvm.finish(h, toks)
    row = rows[0]
    # the locks hold the span [16, 32) before their ends (each leaf [12, 32) is cut at 16)
    locks = [cache.lock(cache.match_prefix(toks).node) for toks in (a, b)]
    assert cache.evict({chunk: 3})[chunk] >= 3  # the inner node [0, 12) (and maybe a leaf's [12, 16))
    chunk_res, window_res = mem.resident(row, chunk), mem.resident(row, WindowPool(8))
    assert not chunk_res[:3].any() and chunk_res[4:].all() and window_res.all()
    cache.check()

    def expected(shared: int) -> int:
        for end in range(shared, -1, -PS):
            chunk_ok = all(chunk_res[q // PS] for q in needed_positions(end, 16))
            window_ok = all(window_res[q // PS] for q in range(max(0, end - 8), end))
            if chunk_ok and window_ok:
                return end
        return 0

    got = {}
    for shared in range(PS, 32, PS):
        query = np.concatenate([a[:shared], a[shared:] + 5000])
        got[shared] = cache.match_prefix(query).length
        assert got[shared] == expected(shared), shared
    assert got[12] == got[16] == 0 and got[20] == 20
    for lock in locks:
        cache.unlock(lock)
    cache.evict({FULL_POOL: 10**6})
    cache.check()


@pytest.mark.parametrize("park", [False, True])
def test_a_request_releases_exactly_the_chunk_pages_outside_its_span(park):
    """``KVManager.release_windows`` releases, per pool, the own pages before the pool id's
    span: for the chunk pool, every page the attention pattern no longer reads. Freed at once,
    or (``park``) window-cached: still resident, held by the cache."""
    mem = make()
    kvm = KVManager(HybridRadixCache(mem), park_windows=park)
    h = kvm.admit(kvm.match(np.arange(1, 41, dtype=np.int64)))
    for seq_len in (3, 7, 8, 13, 16, 22, 25, 32, 38):
        kvm.extend(h, seq_len)
        kvm.release_windows([h])
        pages = np.arange(h.pages.size)
        keep = {q // PS for q in needed_positions(seq_len)} | ({seq_len // PS} if seq_len % PS else set())
        for pool, first in ((ChunkPool(C), min(keep, default=pages.size)), (WindowPool(8), max(0, seq_len - 8) // PS)):
            needed = ~mem.windows.held(pool)[h.pages] if park else mem.resident(h.pages, pool)
            assert np.array_equal(needed, pages >= first), (pool, seq_len)
            assert mem.resident(h.pages, pool).all() or not park
        assert mem.resident(h.pages, FULL_POOL).all()
    kvm.release(h)
    mem.verify()
