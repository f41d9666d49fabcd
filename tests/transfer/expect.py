"""Independent expectation of a transfer plan, from memory views and ``Parallel`` alone.

Built without ``hybridkv.transfer``: addresses come from the strided tensor views memory
hands out (``storage_offset`` and strides, so they work on meta memories too), head ranges
from ``Parallel.kv_head_range``, and the source of each decode row from the rule the
design states: among the prefill ranks that hold a head, decode rank ``d`` reads from
``holders[d % len(holders)]``; replicated tensors from prefill rank ``d % tp``.
"""

from __future__ import annotations

import numpy as np

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import MLA, FullAttention, Linear, SlidingWindow


def _tensors(kind: object) -> list[str]:
    if isinstance(kind, FullAttention | SlidingWindow):
        return ["k", "v"]
    if isinstance(kind, MLA):
        return ["latent"]
    if isinstance(kind, Linear):
        return [s.name for s in kind.states]
    return []


def _positions(kind: object, seq_len: int, page_size: int) -> np.ndarray:
    n = -(-seq_len // page_size)
    if isinstance(kind, SlidingWindow):
        return np.arange(max(0, seq_len - kind.window) // page_size, n)
    return np.arange(n)


def _rows(view, base: int, cells: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Byte address of each row (all item dims but the last) of ``cells``.

    ``index`` holds the row multi-indices (one column per item dim but the last).
    """
    size = view.element_size()
    strides = view.stride()
    elem = view.storage_offset() + cells[:, None] * strides[0]
    for dim in range(index.shape[1]):
        elem = elem + index[None, :, dim] * strides[dim + 1]
    return base + elem * size


def expected_atoms(
    pre: UnifiedMemory,
    pre_base: int,
    pre_pages: np.ndarray,
    pre_slot: int | None,
    dec: UnifiedMemory,
    dec_base: int,
    dec_pages: np.ndarray,
    dec_slot: int | None,
    seq_len: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, length) of every row this prefill rank owes this decode rank."""
    ps, pd = pre.shard, dec.shard
    pt, d = ps.parallel.tp_size, pd.tp_rank
    out_s, out_d, out_n = [], [], []
    for layer in pd.layers:
        lid = layer.layer_id
        kind = layer.kind
        if not ps.has_layer(lid) or not _tensors(kind):
            continue
        if isinstance(kind, Linear):
            pos = np.zeros(1, dtype=np.int64)
            s_cells = pre.pool_of_layer(lid).v2p[[pre_slot]]
            d_cells = dec.pool_of_layer(lid).v2p[[dec_slot]]
        else:
            pos = _positions(kind, seq_len, pre.page_size)
            s_cells = pre.pool_of_layer(lid).v2p[pre_pages[pos]]
            d_cells = dec.pool_of_layer(lid).v2p[dec_pages[pos]]
        for name in _tensors(kind):
            vs, vd = pre.view(lid, name), dec.view(lid, name)
            shape = tuple(vd.shape[1:])
            index = np.indices(shape[:-1]).reshape(len(shape) - 1, -1).T
            row_bytes = shape[-1] * vd.element_size()
            if isinstance(kind, FullAttention | SlidingWindow):
                split, total = 1, kind.num_kv_heads
                d_lo = pd.kv_head_range(lid)[0]
                g = index[:, split] + d_lo
                ranges = [ps.parallel.kv_head_range(total, r) for r in range(pt)]
                holders = [[r for r, (a, b) in enumerate(ranges) if a <= h < b] for h in range(total)]
                src_rank = np.array([holders[h][d % len(holders[h])] for h in g])
                s_lo = np.array([ranges[r][0] for r in src_rank])
            elif isinstance(kind, Linear):
                state = next(s for s in kind.states if s.name == name)
                split = state.tp_dim
                assert split == 0, "expectation covers tp_dim 0 (every preset's states)"
                local_p = state.shape[0] // pt
                g = index[:, 0] + pd.tp_rank * shape[0]
                src_rank = g // local_p
                s_lo = src_rank * local_p
            else:  # MLA: replicated
                split = None
                src_rank = np.full(index.shape[0], d % pt)
                s_lo = np.zeros(index.shape[0], dtype=np.int64)
            mine = src_rank == ps.tp_rank
            if not mine.any():
                continue
            d_index = index[mine]
            s_index = d_index.copy()
            if split is not None:
                s_index[:, split] = g[mine] - s_lo[mine]
            out_d.append(_rows(vd, dec_base, d_cells, d_index).ravel())
            out_s.append(_rows(vs, pre_base, s_cells, s_index).ravel())
            out_n.append(np.full(out_d[-1].size, row_bytes))
    if not out_d:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(out_s), np.concatenate(out_d), np.concatenate(out_n)


def merge_runs(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs contiguous on both sides, by destination (a plain loop)."""
    order = np.argsort(dst, kind="stable")
    runs: list[list[int]] = []
    for s, d, n in zip(src[order].tolist(), dst[order].tolist(), length[order].tolist(), strict=True):
        if runs and runs[-1][1] + runs[-1][2] == d and runs[-1][0] + runs[-1][2] == s:
            runs[-1][2] += n
        else:
            runs.append([s, d, n])
    return [tuple(r) for r in runs]
