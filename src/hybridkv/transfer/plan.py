"""Transfer plans: a request's pages and slot -> coalesced ``(src, dst, length)`` arrays.

A plan is computed on the host from layouts (``BufferSet``), entry pairs and host cell ids
(``pool.v2p``); it never reads a device tensor.

Invariants:
- Full-history entries (full, MLA) send every page of the request, sliding-window entries
  only the pages holding tokens ``[seq_len - window, seq_len)``, state entries one slot.
- When TP sizes differ, each item is cut along its sharded dimension into the pieces this
  prefill rank supplies (``slicing.source_pieces``); every decode byte has one source.
- Every cell id lies in ``[1, count)`` (0 is the padding sink, -1 a tombstone), every
  source range in what prefill registered and every destination range in what decode
  registered; no two destination ranges overlap. Any violation raises ``PlanError``
  before a byte moves.
- Ops are sorted by destination and maximal: adjacent pieces contiguous on both sides are
  merged, so the number of ops equals the number of contiguous runs. A destination-only
  plan (no source cells: what decode computes to verify checksums) merges on the
  destination alone; its byte order is the same as the full plan's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.memory import UnifiedMemory
from hybridkv.transfer.buffers import BufferEntry, BufferSet
from hybridkv.transfer.errors import PlanError
from hybridkv.transfer.pairing import EntryPair
from hybridkv.transfer.slicing import source_pieces

_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class TransferPlan:
    src: np.ndarray  # int64 source addresses (prefill); zeros in a destination-only plan
    dst: np.ndarray  # int64 destination addresses (decode), ascending
    length: np.ndarray  # int64 bytes per op
    pieces: int  # elementary pieces before coalescing

    @property
    def num_ops(self) -> int:
        return int(self.dst.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def chunks(self, max_ops: int, max_bytes: int) -> list[slice]:
        """Consecutive op ranges of at most ``max_ops`` ops and about ``max_bytes`` bytes.

        A single op larger than ``max_bytes`` is a chunk of its own.
        """
        ends = np.cumsum(self.length)
        out, i = [], 0
        while i < self.num_ops:
            base = int(ends[i - 1]) if i else 0
            j = int(np.searchsorted(ends, base + max_bytes, side="right"))
            j = min(max(j, i + 1), i + max_ops)
            out.append(slice(i, j))
            i = j
        return out


def num_pages(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def request_positions(entry: BufferEntry, seq_len: int) -> np.ndarray:
    """Positions (page index within the request, or 0 for the state slot) an entry sends."""
    if entry.kind == "state":
        return np.zeros(1, dtype=np.int64)
    n = num_pages(seq_len, entry.page_size)
    first = max(0, seq_len - entry.window) // entry.page_size if entry.window else 0
    return np.arange(first, n, dtype=np.int64)


def memory_cells(mem: UnifiedMemory, pages: np.ndarray, slot: int | None) -> dict[str, np.ndarray]:
    """Host cell ids of a request in every pool of ``mem`` (tombstones stay -1)."""
    pages = np.asarray(pages, dtype=np.int64)
    out = {}
    for name, pool in mem.pools.items():
        if pool.layout.is_state:
            out[name] = pool.v2p[[slot]] if slot is not None else _EMPTY
        else:
            out[name] = pool.v2p[pages]
    return out


def _cells(
    cells: Mapping[str, np.ndarray], entry: BufferEntry, positions: np.ndarray, role: str, lid: int
) -> np.ndarray:
    have = cells.get(entry.pool)
    need = int(positions[-1]) + 1 if positions.size else 0
    unit = "state slot" if entry.kind == "state" else "pages"
    if have is None or len(have) < need:
        raise PlanError(
            f"{role} gave {0 if have is None else len(have)} {unit} for pool {entry.pool!r} "
            f"(layer {lid}), the request needs {need}"
        )
    picked = np.asarray(have, dtype=np.int64)[positions]
    bad = (picked < 1) | (picked >= entry.count)
    if bad.any():
        i = int(np.argmax(bad))
        what = "a tombstone (not resident)" if picked[i] == -1 else f"outside [1, {entry.count})"
        raise PlanError(
            f"{role} cell {picked[i]} for position {positions[i]} of pool {entry.pool!r} (layer {lid}) is {what}"
        )
    return picked


def _item_chunks(a: BufferEntry, b: BufferEntry, start: int, end: int) -> tuple[np.ndarray, ...]:
    """Byte (src offset, dst offset, length) of the part ``[start, end)`` inside one item."""
    k = a.shard_dim
    if k is None or (a.shape[k] == b.shape[k] == end - start):
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([a.item_len], np.int64)
    outer = math.prod(a.shape[:k])
    inner = math.prod(a.shape[k + 1 :]) * a.itemsize
    j = np.arange(outer, dtype=np.int64)
    src = (j * a.shape[k] + (start - a.shard_start)) * inner
    dst = (j * b.shape[k] + (start - b.shard_start)) * inner
    return src, dst, np.full(outer, (end - start) * inner, dtype=np.int64)


def build_plan(
    prefill: BufferSet,
    decode: BufferSet,
    pairs: Sequence[EntryPair],
    seq_len: int,
    src_cells: Mapping[str, np.ndarray] | None,
    dst_cells: Mapping[str, np.ndarray],
) -> TransferPlan:
    """The ops that move this prefill rank's share of one request into one decode rank.

    ``src_cells``/``dst_cells`` map pool names to the request's cells (page position ->
    cell; one cell for the state pool). ``src_cells=None`` gives a destination-only plan.
    """
    if seq_len < 1:
        raise PlanError(f"seq_len must be >= 1, got {seq_len}")
    src_parts, dst_parts, len_parts = [], [], []
    for pair in pairs:
        a, b = prefill.entries[pair.src], decode.entries[pair.dst]
        where = f"{prefill.describe('prefill')} -> {decode.describe('decode')} layer {pair.layer_id}"
        pieces = source_pieces(
            a.shard_total if a.shard_dim is not None else None,
            prefill.tp_size,
            a.shard_len,
            b.shard_start,
            b.shard_len,
            decode.tp_rank,
            where,
        )
        mine = [p for p in pieces if p.src_rank == prefill.tp_rank]
        if not mine:
            continue
        positions = request_positions(b, seq_len)
        if positions.size == 0:
            continue
        d_cells = _cells(dst_cells, b, positions, "decode", pair.layer_id)
        s_cells = (
            _cells(src_cells, a, positions, "prefill", pair.layer_id)
            if src_cells is not None
            else np.zeros_like(d_cells)
        )
        for piece in mine:
            s_off, d_off, ln = _item_chunks(a, b, piece.start, piece.end)
            if src_cells is not None:
                src_parts.append((a.addr + s_cells[:, None] * a.stride + s_off).ravel())
            dst_parts.append((b.addr + d_cells[:, None] * b.stride + d_off).ravel())
            len_parts.append(np.broadcast_to(ln, (positions.size, ln.size)).ravel())
    dst = np.concatenate(dst_parts) if dst_parts else _EMPTY
    length = np.concatenate(len_parts) if len_parts else _EMPTY
    src = np.concatenate(src_parts) if src_cells is not None and src_parts else np.zeros_like(dst)
    _check_inside(dst, length, decode.regions, decode.describe("decode"))
    if src_cells is not None:
        _check_inside(src, length, prefill.regions, prefill.describe("prefill"))
    return _coalesce(src, dst, length, merge_src=src_cells is not None)


def _check_inside(addr: np.ndarray, length: np.ndarray, regions: Sequence[tuple[int, int]], who: str) -> None:
    inside = np.zeros(addr.size, dtype=bool)
    for start, size in regions:
        inside |= (addr >= start) & (addr + length <= start + size)
    if not inside.all():
        i = int(np.argmax(~inside))
        raise PlanError(
            f"range [{addr[i]:#x}, {addr[i] + length[i]:#x}) lies outside every region "
            f"{who} registered ({[(hex(a), n) for a, n in regions]})"
        )


def _coalesce(src: np.ndarray, dst: np.ndarray, length: np.ndarray, merge_src: bool) -> TransferPlan:
    pieces = int(dst.size)
    if pieces == 0:
        return TransferPlan(_EMPTY, _EMPTY, _EMPTY, 0)
    order = np.argsort(dst, kind="stable")
    src, dst, length = src[order], dst[order], length[order]
    end = dst[:-1] + length[:-1]
    overlap = end > dst[1:]
    if overlap.any():
        i = int(np.argmax(overlap))
        raise PlanError(
            f"two pieces write the same decode bytes at {dst[i + 1]:#x} (a page or slot given "
            "twice in the request's destination cells?)"
        )
    joined = end == dst[1:]
    if merge_src:
        joined &= src[:-1] + length[:-1] == src[1:]
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    total = np.add.reduceat(length, starts)
    return TransferPlan(src[starts].copy(), dst[starts].copy(), total.astype(np.int64), pieces)
