"""The conservation check: every byte accounted for exactly once, every table consistent.

Recomputes everything it checks from first principles (cell states, slab owners, byte
intervals) instead of trusting the counters it is checking. Reads device tables, so it is a
test / debug tool, never called on the hot path.
"""

from __future__ import annotations

import numpy as np

from hybridkv.memory.arena import FREE_SLAB
from hybridkv.memory.pool import FREE, LIVE, UNUSABLE, CellStatus, SubPool
from hybridkv.memory.view import MemoryView
from hybridkv.memory.virtual import VirtualIds


def _fail(msg: str) -> None:
    raise AssertionError(f"memory verify: {msg}")


def verify_memory(mem: MemoryView) -> None:
    arena = mem.arena
    slab_live = np.zeros(arena.num_slabs, dtype=np.int64)
    accounted = arena.sink_bytes + arena.tail_bytes + arena.free_slabs * arena.slab_bytes
    for pool in mem.pools.values():
        accounted += _verify_pool(mem, pool, slab_live)
    if accounted != arena.nbytes:
        _fail(f"bytes accounted {accounted} != arena {arena.nbytes}")
    if not np.array_equal(slab_live, arena.slab_live):
        j = int(np.argmax(slab_live != arena.slab_live))
        _fail(f"slab {j}: live count {arena.slab_live[j]} but {slab_live[j]} live cells touch it")
    empty_owned = np.flatnonzero((arena.owner != FREE_SLAB) & (slab_live == 0))
    spares = {pool.spare_slab for pool in mem.pools.values()}
    for slab in empty_owned:
        if int(slab) not in spares:
            _fail(f"slab {int(slab)} is owned but holds no live cell and is not its pool's spare")

    _verify_namespace(mem.pages, [p for p in mem.history_pools], mem.window_pools, "page")
    _verify_namespace(mem.slots, mem.slot_pools, [], "slot")

    pages, slots = mem.gates.recount()
    if not (np.array_equal(pages, mem.gates.page_pins) and np.array_equal(slots, mem.gates.slot_pins)):
        _fail("pin counts differ from the open gates")
    if (~mem.pages.live[pages > 0]).any() or (~mem.slots.live[slots > 0]).any():
        _fail("a pinned id is not live")
    for ids in (mem.pages, mem.slots):
        stray = ids.held & ~ids.live
        if stray.any():
            _fail(f"{ids.label} {int(np.argmax(stray))} is marked held but not live")
    _verify_window_held(mem)


def _verify_window_held(mem: MemoryView) -> None:
    """Window-cached cells, their own category: held by the page holder, live, resident, not
    needed whole by the holder (a cached page's cells are its own), counted exactly."""
    total = 0
    for pool in mem.window_pools:
        marks = mem.windows.held(pool.pool_id)
        held = np.flatnonzero(marks)
        if held.size != mem.windows.held_count(pool.pool_id):
            _fail(f"{pool.pool_id}: {held.size} window-cached cells, counted {mem.windows.held_count(pool.pool_id)}")
        if held.size and mem.pages.holder is None:
            _fail(f"{pool.pool_id}: window-cached cells but no holder of page ids")
        for bad, why in (
            (~mem.pages.live[held], "not live"),
            (pool.v2p[held] < 0, "not resident there"),
            (mem.pages.held[held], "held whole by the holder as well (counted twice)"),
        ):
            if bad.any():
                _fail(f"page {int(held[np.argmax(bad)])} is window-cached in {pool.pool_id} but {why}")
        total += held.size
    if total != mem.windows.holds.total:
        _fail(f"window-cached cells: {total} marked, total counter {mem.windows.holds.total}")


def _verify_pool(mem: MemoryView, pool: SubPool, slab_live: np.ndarray) -> int:
    """Check one pool; add its live cells to ``slab_live``; return the bytes of its slabs."""
    arena, name, cell = mem.arena, str(pool.pool_id), pool.cell_bytes
    if pool.v2p[0] != 0 or pool.p2v[0] != 0:
        _fail(f"{name}: sink entry moved (v2p[0]={pool.v2p[0]}, p2v[0]={pool.p2v[0]})")
    cells = np.arange(1, pool.grid_cells)
    status = pool.status[1:]
    usable = pool.usable(cells)
    if ((status != UNUSABLE) != usable).any():
        c = int(cells[np.argmax((status != UNUSABLE) != usable)])
        _fail(f"{name}: cell {c} is {CellStatus(pool.status[c]).name} but slab ownership disagrees")
    live = cells[status == LIVE]
    free = cells[status == FREE]
    if live.size != pool.live_count or free.size != pool.free_count:
        _fail(f"{name}: counters live={pool.live_count} free={pool.free_count}, cells say {live.size}/{free.size}")
    starts = live * cell
    if (starts < arena.sink_bytes).any():
        _fail(f"{name}: a live cell overlaps the sink")
    mapped = pool.p2v[cells] >= 0
    if (mapped != (status == LIVE)).any():
        c = int(cells[np.argmax(mapped != (status == LIVE))])
        _fail(f"{name}: cell {c} is {'mapped' if mapped[c - 1] else 'unmapped'} but {CellStatus(pool.status[c]).name}")
    if (pool.v2p[pool.p2v[live]] != live).any():
        _fail(f"{name}: v2p[p2v[c]] != c for a live cell")
    bound = np.flatnonzero(pool.v2p >= 0)
    bound = bound[bound > 0]
    if (pool.p2v[pool.v2p[bound]] != bound).any():
        _fail(f"{name}: p2v[v2p[v]] != v for a bound id")
    stack = pool.free_cells()
    if stack.size != free.size or not np.array_equal(np.sort(stack), free):
        _fail(f"{name}: the free stack does not hold exactly the FREE cells once each")
    np.add.at(slab_live, pool.cell_lo[live], 1)
    straddle = pool.cell_hi[live] != pool.cell_lo[live]
    np.add.at(slab_live, pool.cell_hi[live][straddle], 1)
    if not np.array_equal(pool.v2p_dev.cpu().numpy(), pool.v2p):
        _fail(f"{name}: device v2p differs from the host table")
    if not np.array_equal(pool.p2v_dev.cpu().numpy(), pool.p2v):
        _fail(f"{name}: device p2v differs from the host table")

    # bytes: every usable cell lies wholly inside slabs this pool owns (recomputed here)
    slabs = pool.owned_slabs()
    used = np.concatenate([live, free])
    s0 = used * cell
    s1 = s0 + cell
    sink, size, owner = arena.sink_bytes, arena.slab_bytes, arena.owner
    lo, hi = (s0 - sink) // size, (s1 - 1 - sink) // size
    if used.size and ((lo < 0).any() or (hi >= arena.num_slabs).any() or (hi - lo > 1).any()):
        _fail(f"{name}: a usable cell reaches the sink, the tail, or spans more than two slabs")
    in_lo = np.minimum(s1, sink + (lo + 1) * size) - s0
    in_hi = np.where(hi != lo, s1 - (sink + hi * size), 0)
    covered = np.where(owner[lo] == pool.index, in_lo, 0) + np.where(owner[hi] == pool.index, in_hi, 0)
    if int(covered.sum()) != used.size * cell:
        _fail(f"{name}: usable cells cover {int(covered.sum())} B of owned slabs, expected {used.size * cell}")
    return int(slabs.size) * arena.slab_bytes


def _verify_namespace(ids: VirtualIds, required: list[SubPool], optional: list[SubPool], what: str) -> None:
    live = ids.live.copy()
    live[0] = False
    for pool in required:
        resident = pool.v2p >= 0
        resident[0] = False
        if not np.array_equal(resident, live):
            v = int(np.argmax(resident != live))
            _fail(f"{what} {v}: live={live[v]} but resident in {pool.pool_id}={resident[v]}")
    for pool in optional:
        resident = pool.v2p >= 0
        resident[0] = False
        if (resident & ~live).any():
            _fail(f"{what} {int(np.argmax(resident & ~live))} is resident in {pool.pool_id} but not live")
    free = ids.free_ids()
    if free.size != np.unique(free).size:
        _fail(f"{what}: free list holds an id twice")
    if not np.array_equal(np.sort(free), np.flatnonzero(~ids.live)):
        _fail(f"{what}: free list and live flags disagree")
