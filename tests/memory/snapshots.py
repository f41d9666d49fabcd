"""Snapshots of every host table of a UnifiedMemory, and every counter and hint of its arena,
broker, id spaces and pools, to prove a refused call changed nothing."""

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
    for name, obj in [("arena", mem.arena), ("broker", mem.broker), ("pages", mem.pages), ("slots", mem.slots)]:
        snap.update(_scalars(name, obj))
    for name, pool in mem.pools.items():
        snap.update(_scalars(str(name), pool))  # counts and hints: last_slab, spare_slab, ...
    for pool in mem.window_pools:
        snap[f"{pool.pool_id}.window_held"] = mem.windows.held(pool.pool_id).copy()
    if mem.arena.has_data:
        snap["bytes"] = mem.arena.buffer.cpu().numpy().copy()
    return snap


def _scalars(prefix: str, obj: object) -> dict[str, np.ndarray]:
    """Every plain attribute of ``obj`` (ints, floats, bools, strings, None) and every numpy
    array it holds directly: counters and hints that no table shows."""
    out = {}
    for key, value in vars(obj).items():
        if key == "_stack":
            continue  # free stacks: compared up to their free count (free_stack, pages.free); scratch beyond
        if isinstance(value, np.ndarray):
            out[f"{prefix}.{key}"] = value.copy()
        elif value is None or isinstance(value, int | float | str | np.integer):
            out[f"{prefix}.{key}"] = np.array(repr(value))
    return out


def assert_unchanged(before: dict[str, np.ndarray], mem: UnifiedMemory) -> None:
    after = snapshot(mem)
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert not changed, f"a refused call changed: {changed}"
