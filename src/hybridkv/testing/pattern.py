"""A byte pattern that encodes (layer, tensor, page position, offset) in global coordinates.

Every byte of a layer's *unsharded* tensor for one page position (or the state slot) gets
a hash of (seed, layer, tensor, position, byte index); a TP rank holds its slice of that
global tensor along the tensor's own ``tp_dim`` (heads for K/V, whatever dimension a state
tensor splits; a replicated tensor is held whole). Prefill ranks fill their pages with it; decode checks its whole arena
against ``expected_arena``: the pattern exactly where the request's bytes must land,
zeros everywhere else. So a byte from the wrong layer, page, head or offset, a byte
missing, or a byte written where it should not be, all show up.
"""

from __future__ import annotations

import numpy as np

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import IdSpace


def _hash(x: np.ndarray) -> np.ndarray:
    x = (x * 0x9E3779B1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x85EBCA77) & 0xFFFFFFFF
    x ^= x >> 13
    return (x & 0xFF).astype(np.uint8)


def _local_bytes(mem: UnifiedMemory, lid: int, tensor: int, name: str, position: int, seed: int) -> np.ndarray:
    """This rank's bytes of the global tensor ``name`` of layer ``lid`` at ``position``: the
    slice along the segment's ``tp_dim`` (any dimension; None: the whole tensor)."""
    shard = mem.shard
    layout = mem.pool_of_layer(lid).layout
    seg = layout.segment(lid, name)
    size = seg.dtype.itemsize
    whole = shard.model.layer(lid).kind.cell_tensors(layout.page_size, shard.model.kv_dtype)
    shape = next(t.shape for t in whole if t.name == name)
    rows = (*shape[:-1], shape[-1] * size)  # the last dim in bytes
    cut = [slice(None)] * len(rows)
    if seg.tp_dim is not None:
        dim, local = seg.tp_dim, seg.shape[seg.tp_dim]
        replicas = shard.parallel.tp_size // (shape[dim] // local)  # ranks holding one slice
        lo = shard.tp_rank // replicas * local
        scale = size if dim == len(rows) - 1 else 1
        cut[dim] = slice(lo * scale, (lo + local) * scale)
    key = seed * 7_919 + lid * 1_000_003 + tensor * 104_729 + position * 15_485_863
    glob = _hash(key + np.arange(int(np.prod(rows)), dtype=np.int64)).reshape(rows)
    return np.ascontiguousarray(glob[tuple(cut)]).reshape(-1)


def _places(mem: UnifiedMemory, pages: np.ndarray, slot: int | None, seq_len: int, window_only: bool):
    """(arena offset, layer, tensor index, name, position) of every segment of the request;
    ``window_only``: only the pages each pool's history rule keeps at ``seq_len``."""
    n = -(-seq_len // mem.page_size)
    for layer in mem.shard.layers:
        if layer.kind.pool_id is None:
            continue
        pool = mem.pool_of_layer(layer.layer_id)
        segs = [s for s in pool.layout.segments if s.layer_id == layer.layer_id]
        if pool.layout.id_space is IdSpace.SLOT:
            positions = [0]
            cells = [int(pool.v2p[slot])]
        else:
            first = pool.pool_id.page_span(seq_len, mem.page_size)[0] if window_only else 0
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
    """A zero arena with each request's pattern where it must land (for a pool that releases
    history, only the pages its rule keeps)."""
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
