"""A byte pattern that encodes (layer, tensor, page position, offset) in global coordinates.

Every byte of a layer's *unsharded* tensor for one page position (or the state slot) gets
a hash of (seed, layer, tensor, position, byte index); a TP rank holds its slice of that
global tensor. Prefill ranks fill their pages with it; decode checks its whole arena
against ``expected_arena``: the pattern exactly where the request's bytes must land,
zeros everywhere else. So a byte from the wrong layer, page, head or offset, a byte
missing, or a byte written where it should not be, all show up.
"""

from __future__ import annotations

import numpy as np

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import MLA, FullAttention, Linear, SlidingWindow


def _hash(x: np.ndarray) -> np.ndarray:
    x = (x * 0x9E3779B1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x85EBCA77) & 0xFFFFFFFF
    x ^= x >> 13
    return (x & 0xFF).astype(np.uint8)


def _local_bytes(mem: UnifiedMemory, lid: int, tensor: int, name: str, position: int, seed: int) -> np.ndarray:
    """This rank's bytes of the global tensor ``name`` of layer ``lid`` at ``position``."""
    shard = mem.shard
    kind = shard.model.layer(lid).kind
    seg = mem.pool_of_layer(lid).layout.segment(lid, name)
    size = seg.dtype.itemsize
    rows: tuple[int, ...]
    cut: tuple[slice, ...]
    if isinstance(kind, FullAttention | SlidingWindow):
        lo, hi = shard.kv_head_range(lid)
        rows = (seg.shape[0], kind.num_kv_heads, seg.shape[2] * size)
        cut = (slice(None), slice(lo, hi))
    elif isinstance(kind, Linear):
        state = next(s for s in kind.states if s.name == name)
        local = seg.shape[0]
        rows = (state.shape[0], seg.nbytes // local)
        cut = (slice(shard.tp_rank * local, (shard.tp_rank + 1) * local),)
    else:
        rows = (seg.nbytes,)
        cut = (slice(None),)
    key = seed * 7_919 + lid * 1_000_003 + tensor * 104_729 + position * 15_485_863
    glob = _hash(key + np.arange(int(np.prod(rows)), dtype=np.int64)).reshape(rows)
    return np.ascontiguousarray(glob[cut]).reshape(-1)


def _places(mem: UnifiedMemory, pages: np.ndarray, slot: int | None, seq_len: int, window_only: bool):
    """(arena offset, layer, tensor index, name, position) of every segment of the request."""
    n = -(-seq_len // mem.page_size)
    for layer in mem.shard.layers:
        kind = layer.kind
        if not isinstance(kind, FullAttention | SlidingWindow | Linear | MLA):
            continue
        pool = mem.pool_of_layer(layer.layer_id)
        segs = [s for s in pool.layout.segments if s.layer_id == layer.layer_id]
        if isinstance(kind, Linear):
            positions = [0]
            cells = [int(pool.v2p[slot])]
        else:
            first = (
                max(0, seq_len - kind.window) // mem.page_size if isinstance(kind, SlidingWindow) and window_only else 0
            )
            positions = list(range(first, n))
            cells = [int(c) for c in pool.v2p[pages[first:n]]]
        for t, seg in enumerate(segs):
            for position, cell in zip(positions, cells, strict=True):
                yield cell * pool.cell_bytes + seg.offset, layer.layer_id, t, seg.tensor, position


def fill(mem: UnifiedMemory, pages: np.ndarray, slot: int | None, seq_len: int, seed: int) -> None:
    """Write the pattern into every page (all of them, also outside windows) and the slot."""
    arena = mem.arena.buffer.numpy()
    for offset, lid, t, name, position in _places(mem, pages, slot, seq_len, window_only=False):
        data = _local_bytes(mem, lid, t, name, position, seed)
        arena[offset : offset + data.size] = data


Request = tuple[np.ndarray, int | None, int, int]  # pages, slot, seq_len, seed


def expected_arena(mem: UnifiedMemory, requests: list[Request]) -> np.ndarray:
    """A zero arena with each request's pattern where it must land (window pages for SWA)."""
    out = np.zeros(mem.arena.nbytes, dtype=np.uint8)
    for pages, slot, seq_len, seed in requests:
        for offset, lid, t, name, position in _places(mem, pages, slot, seq_len, window_only=True):
            data = _local_bytes(mem, lid, t, name, position, seed)
            out[offset : offset + data.size] = data
    return out


def mismatch(mem: UnifiedMemory, want: np.ndarray) -> str:
    """'' when the arena equals ``want``, else where the first wrong byte is."""
    got = mem.arena.buffer.numpy()
    bad = np.flatnonzero(got != want)
    if not bad.size:
        return ""
    return f"{bad.size} wrong bytes, first at arena offset {bad[0]} (got {got[bad[0]]}, want {want[bad[0]]})"
