"""Independent expectation of a transfer plan, from memory views and ``Parallel`` alone.

Built without ``hybridkv.transfer``: addresses come from the strided tensor views memory
hands out (``storage_offset`` and strides, so they work on meta memories too), the pages
from each kind's pool rule, each tensor's TP slice along its own ``tp_dim`` from
``Parallel.kv_head_range`` (the split rule, replicas included), and the source of each
decode row from the rule the design states: among the prefill ranks that hold a slice,
decode rank ``d`` reads from ``holders[d % len(holders)]``; replicated tensors from
prefill rank ``d % tp``.
"""

from __future__ import annotations

import numpy as np

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import IdSpace, LayerKind


def _tensors(kind: LayerKind, cell_tokens: int, kv_dtype) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, unsharded shape, tp_dim) of every tensor the kind keeps per cell."""
    return [(t.name, t.shape, t.tp_dim) for t in kind.cell_tensors(cell_tokens, kv_dtype)]


def _positions(kind: LayerKind, seq_len: int, page_size: int) -> np.ndarray:
    """Row pages the kind's history rule keeps at ``seq_len``."""
    assert kind.pool_id is not None
    n = -(-seq_len // page_size)
    return np.arange(kind.pool_id.first_needed(seq_len) // page_size, n)


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
        if not ps.has_layer(lid) or kind.pool_id is None:
            continue
        slots = kind.pool_id.id_space is IdSpace.SLOT
        if slots:
            pos = np.zeros(1, dtype=np.int64)
            s_cells = pre.pool_of_layer(lid).v2p[[pre_slot]]
            d_cells = dec.pool_of_layer(lid).v2p[[dec_slot]]
        else:
            pos = _positions(kind, seq_len, pre.page_size)
            s_cells = pre.pool_of_layer(lid).v2p[pre_pages[pos]]
            d_cells = dec.pool_of_layer(lid).v2p[dec_pages[pos]]
        for name, whole, split in _tensors(kind, 1 if slots else pre.page_size, pd.model.kv_dtype):
            vs, vd = pre.view(lid, name), dec.view(lid, name)
            shape = tuple(vd.shape[1:])
            # a row is the item's last dim, unless TP splits that one: then one element
            row_dims = len(shape) if split == len(shape) - 1 else len(shape) - 1
            index = np.indices(shape[:row_dims]).reshape(row_dims, -1).T
            row_bytes = (shape[-1] if row_dims < len(shape) else 1) * vd.element_size()
            if split is not None:
                total = whole[split]
                d_lo = pd.parallel.kv_head_range(total, d)[0]  # Parallel's split, replicas included
                g = index[:, split] + d_lo
                ranges = [ps.parallel.kv_head_range(total, r) for r in range(pt)]
                holders = [[r for r, (a, b) in enumerate(ranges) if a <= h < b] for h in range(total)]
                src_rank = np.array([holders[h][d % len(holders[h])] for h in g])
                s_lo = np.array([ranges[r][0] for r in src_rank])
            else:  # replicated (MLA latents, unsplit state)
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
