"""No fixed split: any pool can grow into bytes another pool freed; compaction makes room.

For each shape (full + SWA; full + state; full + two SWA windows + state) every pool in
turn is driven until the arena is full, then released: each must reach most of the slab
bytes on its own, which no static split can allow for more than one pool at a time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.memory import GateStatus, OutOfMemory, PinnedError, UnifiedMemory
from hybridkv.spec import FULL_POOL, RECURRENT_POOL, PoolId, ShardSpec, get_preset
from tests.memory.snapshots import assert_unchanged, snapshot


def fill(alloc_one) -> list[np.ndarray]:
    out = []
    while True:
        try:
            out.append(alloc_one())
        except OutOfMemory:
            return out


def slab_share(mem: UnifiedMemory, pool: PoolId) -> float:
    return mem.pools[pool].owned_slabs().size / mem.arena.num_slabs


@pytest.mark.parametrize("preset", ["tiny-swa", "tiny-gdn", "tiny-swa2-state"])
def test_each_kind_can_take_most_of_the_arena_in_turn(preset):
    mem = UnifiedMemory.create(
        ShardSpec.whole(get_preset(preset)), 400_000, page_size=4, max_context=32, chunk_tokens=8
    )
    if mem.slot_pools:  # 1. recurrent state alone
        slots = fill(lambda: mem.alloc_state(1))
        assert slab_share(mem, RECURRENT_POOL) > 0.9
        mem.free_state(np.concatenate(slots))
        mem.verify()

    def page_out_of_window() -> np.ndarray:
        page = mem.alloc_pages(1)
        if mem.window_pools:
            mem.windows.free(page)
        return page

    pages = fill(page_out_of_window)  # 2. long sequences: windows slide, full KV stays
    assert sum(slab_share(mem, p.pool_id) for p in mem.history_pools) > 0.9
    mem.free_pages(np.concatenate(pages))
    mem.verify()
    pages = fill(lambda: mem.alloc_pages(1))  # 3. short sequences: every KV pool together
    shares = {p.pool_id: slab_share(mem, p.pool_id) for p in mem.token_pools}
    assert sum(shares.values()) > 0.9, shares
    cells = {p.pool_id: p.cell_bytes for p in mem.token_pools}
    for name, share in shares.items():  # each KV pool holds bytes in proportion to its cell size
        assert share == pytest.approx(cells[name] / sum(cells.values()), abs=0.08), (shares, cells)
    mem.free_pages(np.concatenate(pages))
    mem.verify()
    assert mem.arena.num_slabs - mem.arena.free_slabs <= len(mem.pools)  # at most a spare each
    mem.compact()  # idle compaction hands the spares back too
    assert mem.arena.free_slabs == mem.arena.num_slabs


def test_compaction_moves_pages_so_state_can_have_whole_slabs():
    mem = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-gdn")), 300_000, page_size=4, max_context=32, chunk_tokens=8
    )
    pages = np.concatenate(fill(lambda: mem.alloc_pages(1)))
    full = mem.pools[FULL_POOL]
    grid = mem.arena.cell_grid(full.grid_cells, full.cell_bytes)
    grid[full.v2p[pages], :8] = torch.from_numpy(pages).view(torch.uint8).reshape(-1, 8)
    slab_of = full.cell_lo[full.v2p[pages]]
    keep = pages[np.unique(slab_of, return_index=True)[1]]  # one page in every slab
    mem.free_pages(np.setdiff1d(pages, keep))
    assert mem.arena.free_slabs == 0
    before = mem.stats().bytes_moved
    slots = mem.alloc_state(2)  # needs whole slabs: only compaction can give them
    assert slots.size == 2 and mem.stats().bytes_moved > before
    moved = grid[full.v2p[keep], :8].contiguous().view(torch.int64).reshape(-1)
    assert torch.equal(moved, torch.from_numpy(keep)), "compaction lost page bytes"
    mem.verify()


def test_pinned_pages_are_never_moved_and_a_blocked_request_changes_nothing():
    mem = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-gdn")), 300_000, page_size=4, max_context=32, chunk_tokens=8
    )
    pages = np.concatenate(fill(lambda: mem.alloc_pages(1)))
    slab_of = mem.pools[FULL_POOL].cell_lo[mem.pools[FULL_POOL].v2p[pages]]
    keep = pages[np.unique(slab_of, return_index=True)[1]]
    mem.free_pages(np.setdiff1d(pages, keep))
    gate = mem.pin(pages=keep)
    before = snapshot(mem)
    with pytest.raises(OutOfMemory, match="no movable slab"):
        mem.alloc_state(2)
    assert_unchanged(before, mem)
    with pytest.raises(PinnedError):
        mem.free_pages(keep[:1])
    assert mem.compact() == 0  # nothing movable while pinned
    gate.release()
    assert gate.status is GateStatus.RELEASED and not mem.gates.page_pins.any()
    assert mem.compact() > 0  # idle compaction packs the kept pages into fewer slabs
    mem.alloc_state(2)
    mem.verify()


def test_stats_report_waste_and_the_split():
    mem = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-swa2-state")), 300_000, page_size=4, max_context=32, chunk_tokens=8
    )
    mem.alloc_pages(5)
    mem.alloc_state(2)
    stats = mem.stats()
    per_pool = {p.pool_id: p for p in stats.pools}
    total = (
        stats.sink_bytes
        + stats.tail_bytes
        + stats.free_slab_bytes
        + sum(p.live_bytes + p.free_bytes + p.edge_waste_bytes for p in stats.pools)
    )
    assert total == stats.budget_bytes
    assert per_pool[FULL_POOL].live_cells == 5 and per_pool[RECURRENT_POOL].live_cells == 2
    assert per_pool[RECURRENT_POOL].edge_waste_bytes == 0  # slabs are a multiple of the largest cell
    assert stats.as_dict()["pools"]["swa:8"]["live_cells"] == 5
