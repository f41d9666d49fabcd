"""Token allocation, release and translation against independent expectations."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from hybridkv.memory import TokenAllocator, UnifiedMemory
from hybridkv.spec import FULL_POOL, RECURRENT_POOL, ShardSpec, WindowPool, get_preset

SWA8 = WindowPool(8)


def make(preset: str = "tiny-swa2-state", budget: int = 400_000, page_size: int = 4) -> UnifiedMemory:
    return UnifiedMemory.create(
        ShardSpec.whole(get_preset(preset)),
        budget,
        page_size=page_size,
        max_context=64,
        chunk_tokens=16,
    )


def expected_extend(prefix, seq, last, new_pages, ps):
    """Reference: walk every new token; reuse the last page until full, then fresh pages."""
    out, k = [], 0
    for p, s, last_loc in zip(prefix, seq, last, strict=True):
        page = last_loc // ps if p > 0 else None
        for pos in range(p, s):
            if pos % ps == 0:
                page = new_pages[k]
                k += 1
            out.append(page * ps + pos % ps)
    assert k == len(new_pages)
    return out


def test_alloc_extend_continues_last_page_then_takes_fresh_pages():
    mem = make()
    ps = mem.page_size
    first = TokenAllocator(mem).alloc_extend([0, 0, 0], [5, 3, 8], [0, 0, 0])
    assert len(first) == 16
    rows = [first[:5], first[5:8], first[8:]]
    pages_before = set(np.flatnonzero(mem.pages.live)[1:])
    prefix = np.array([5, 3, 8])
    seq = np.array([11, 4, 9])
    last = np.array([rows[0][-1], rows[1][-1], rows[2][-1]])
    got = TokenAllocator(mem).alloc_extend(prefix, seq, last)
    new_pages = sorted(set(np.flatnonzero(mem.pages.live)[1:]) - pages_before)
    # new pages are handed out in request order, lowest ids first on a fresh namespace
    assert got.tolist() == expected_extend(prefix, seq, last, new_pages, ps)
    mem.verify()


def test_alloc_decode_opens_a_page_only_at_page_boundaries():
    mem = make()
    ps = mem.page_size
    locs = TokenAllocator(mem).alloc_extend([0, 0], [4, 6], [0, 0])
    out = TokenAllocator(mem).alloc_decode([5, 7], [locs[3], locs[-1]])
    assert out[0] % ps == 0 and out[0] // ps not in {locs[0] // ps}  # new page for position 4
    assert out[1] == locs[-1] + 1  # position 6 continues the page of position 5
    assert mem.pages.live_count == 4
    mem.verify()


def test_every_kv_pool_binds_the_same_virtual_page():
    mem = make()
    pages = mem.alloc_pages(3)
    for pool in mem.token_pools:
        assert (pool.v2p[pages] > 0).all(), pool.pool_id
        assert np.array_equal(pool.p2v[pool.v2p[pages]], pages)
    phys = mem.translate(pages * mem.page_size + 1, FULL_POOL)
    assert torch.equal(phys, torch.from_numpy(mem.pools[FULL_POOL].v2p[pages] * mem.page_size + 1))


def test_window_pages_leave_only_the_window_pool():
    mem = make()
    pages = mem.alloc_pages(4)
    mem.windows.free(pages[:2], SWA8)
    assert not mem.resident(pages[:2], SWA8).any()
    assert mem.resident(pages[:2], WindowPool(24)).all() and mem.resident(pages, FULL_POOL).all()
    assert (mem.translate(pages[:2] * mem.page_size, SWA8) < 0).all()  # tombstones
    mem.verify()
    mem.free_pages(pages)  # full free also drops whatever window residency is left
    assert mem.pages.live_count == 0
    mem.verify()


def test_free_segment_frees_pages_starting_in_the_segment():
    mem = make()
    ps = mem.page_size
    row = TokenAllocator(mem).alloc(10)  # pages of positions [0,4) [4,8) [8,10)
    TokenAllocator(mem).free_segment(row[5:], 5)  # page [4,8) starts before 5: kept; page [8,..) freed
    assert mem.pages.live[row[0] // ps] and mem.pages.live[row[4] // ps]
    assert not mem.pages.live[row[8] // ps]
    TokenAllocator(mem).free_segment(row[:8], 0)
    assert mem.pages.live_count == 0
    mem.verify()


def test_free_group_releases_everything_at_exit_and_nothing_on_error():
    mem = make()
    a, b = TokenAllocator(mem).alloc(8), TokenAllocator(mem).alloc(5)
    with mem.free_group():
        TokenAllocator(mem).free_segment(a, 0)
        TokenAllocator(mem).free(b)
        assert mem.pages.live_count == 4  # buffered, not yet released
    assert mem.pages.live_count == 0
    c = TokenAllocator(mem).alloc(4)
    with pytest.raises(RuntimeError), mem.free_group():
        TokenAllocator(mem).free(c)
        raise RuntimeError("forward failed")
    assert mem.pages.live_count == 1
    mem.verify()


def test_state_fork_copies_bytes_into_a_new_slot():
    mem = make("tiny-gdn")
    slot = mem.alloc_state(1)
    view = mem.view(0, "recurrent_state")
    cell = int(mem.pools[RECURRENT_POOL].v2p[slot[0]])
    view[cell] = torch.arange(view[cell].numel(), dtype=view.dtype).reshape(view[cell].shape)
    fork = mem.fork_state(slot)
    assert fork[0] != slot[0]
    assert torch.equal(view[int(mem.pools[RECURRENT_POOL].v2p[fork[0]])], view[cell])
    mem.free_state(slot)
    assert torch.equal(view[int(mem.pools[RECURRENT_POOL].v2p[fork[0]])].flatten()[:3], torch.tensor([0.0, 1.0, 2.0]))
    mem.verify()


def test_a_fork_of_several_slots_copies_each_into_its_own_new_slot():
    mem = make("tiny-gdn")
    slots = mem.alloc_state(3)
    view = mem.view(0, "recurrent_state")
    cells = [int(c) for c in mem.pools[RECURRENT_POOL].v2p[slots]]
    for i, cell in enumerate(cells):  # one cell at a time and several at once take different copy paths
        view[cell] = float(i + 1)
    forks = mem.fork_state(slots[[2, 0]])
    new_cells = [int(c) for c in mem.pools[RECURRENT_POOL].v2p[forks]]
    assert set(new_cells).isdisjoint(cells)
    assert torch.equal(view[new_cells[0]], view[cells[2]]) and torch.equal(view[new_cells[1]], view[cells[0]])
    mem.verify()


def test_views_are_strided_views_of_the_arena_for_a_stage_not_starting_at_layer_zero():
    from hybridkv.spec import Parallel

    spec = get_preset("tiny-gdn")  # layers: gdn gdn gdn full gdn gdn gdn full
    shard = ShardSpec(spec, Parallel(pp_size=2), pp_rank=1)
    mem = UnifiedMemory.create(shard, 200_000, page_size=4, max_context=64)
    assert shard.bounds == (4, 8)
    with pytest.raises(KeyError, match="not on this shard"):
        mem.view(3, "k")
    k, v = mem.view(7, "k"), mem.view(7, "v")
    assert k.shape[1:] == (4, 4, 8) and v.shape[1:] == (4, 4, 8)
    base = mem.arena.buffer.data_ptr()
    assert base <= k.data_ptr() < base + mem.arena.nbytes
    assert mem.geometry(7)["pool"] == FULL_POOL
    assert mem.geometry(4)["tensors"]["recurrent_state"][0] == (4, 8, 8)
    page = mem.alloc_pages(1)
    cell = int(mem.pools[FULL_POOL].v2p[page[0]])
    k[cell].fill_(3.0)
    seg = mem.layout(FULL_POOL).segment(7, "k")
    raw = mem.arena.buffer[cell * mem.pools[FULL_POOL].cell_bytes + seg.offset :][: seg.nbytes]
    assert torch.equal(raw.view(torch.float32), torch.full((seg.nbytes // 4,), 3.0))


def _resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(resident, all) pages of the memory under ``tensor``, by Linux ``mincore``.

    Asked of the buffer itself, not of the process's resident set: a process whose malloc kept earlier freed
    memory (``host_malloc`` raises glibc's trim threshold) may serve the buffer from pages already resident, which
    leaves the resident set unchanged although every page of the buffer is in.
    """
    import ctypes
    import ctypes.util
    import os

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec)
    assert rc == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec), pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mincore")
def test_an_arenas_own_buffer_is_resident_and_zero_from_its_creation() -> None:
    """Every page of the budget is touched when the arena makes its buffer: no step faults one in later."""
    from hybridkv.memory.arena import Arena

    arena = Arena(64 << 20, 4096, 1 << 20, "cpu")
    resident, pages = _resident_pages(arena.buffer)
    assert resident == pages, f"{pages - resident} of {pages} pages not resident"  # torch.empty leaves them out
    assert int(arena.buffer[:: 1 << 16].count_nonzero()) == 0
