"""Snapshots of every host table of a UnifiedMemory, to prove a refused call changed nothing."""

from __future__ import annotations

import numpy as np

from hybridkv.memory import UnifiedMemory


def snapshot(mem: UnifiedMemory) -> dict[str, np.ndarray]:
    snap = {
        "owner": mem.arena.owner.copy(),
        "slab_live": mem.arena.slab_live.copy(),
        "pages.live": mem.pages.live.copy(),
        "pages.free": mem.pages.free_ids(),
        "slots.live": mem.slots.live.copy(),
        "slots.free": mem.slots.free_ids(),
        "page_pins": mem.gates.page_pins.copy(),
    }
    for name, pool in mem.pools.items():
        snap[f"{name}.v2p"] = pool.v2p.copy()
        snap[f"{name}.p2v"] = pool.p2v.copy()
        snap[f"{name}.status"] = pool.status.copy()
        snap[f"{name}.free_stack"] = pool.free_cells()
        snap[f"{name}.v2p_dev"] = pool.v2p_dev.cpu().numpy().copy()
    for pool in mem.window_pools:
        snap[f"{pool.pool_id}.window_held"] = mem.window_held(pool.pool_id).copy()
    if mem.arena.has_data:
        snap["bytes"] = mem.arena.buffer.cpu().numpy().copy()
    return snap


def assert_unchanged(before: dict[str, np.ndarray], mem: UnifiedMemory) -> None:
    after = snapshot(mem)
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert not changed, f"a refused call changed: {changed}"
