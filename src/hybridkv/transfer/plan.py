"""Transfer plans: a request's pages and slot -> coalesced ``(src, dst, length)`` arrays.

A plan is computed on the host from layouts (``BufferSet``), entry pairs and host cell ids
(``UnifiedMemory.host_cells``); it never reads a device tensor.

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
        if self.num_ops <= max_ops and self.nbytes <= max_bytes:
            return [slice(0, self.num_ops)] if self.num_ops else []
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


def positions(kind: str, window: int | None, page_size: int, seq_len: int) -> np.ndarray:
    """Positions (page index within the request, or 0 for the state slot) an entry sends."""
    if kind == "state":
        return np.zeros(1, dtype=np.int64)
    first = max(0, seq_len - window) // page_size if window else 0
    return np.arange(first, num_pages(seq_len, page_size), dtype=np.int64)


def memory_cells(mem: UnifiedMemory, pages: np.ndarray, slot: int | None) -> dict[str, np.ndarray]:
    """Host cell ids of a request in every pool of ``mem`` (tombstones stay -1)."""
    out = {}
    for name, pool in mem.pools.items():
        if pool.layout.is_state:
            out[name] = mem.host_cells([slot], name) if slot is not None else _EMPTY
        else:
            out[name] = mem.host_cells(pages, name)
    return out


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


@dataclass(frozen=True)
class _Group:
    """Entry pairs that share pools, strides and page rule: one broadcast per request."""

    src_pool: str
    dst_pool: str
    kind: str
    window: int | None
    page_size: int
    src_stride: int
    dst_stride: int
    src_count: int
    dst_count: int
    layer: int  # a layer of the group, for messages
    src_off: np.ndarray  # absolute address of item 0 plus the chunk offset, per chunk
    dst_off: np.ndarray
    length: np.ndarray

    def cells(self, cells: Mapping[str, np.ndarray], role: str, where: np.ndarray) -> np.ndarray:
        pool, count = (self.src_pool, self.src_count) if role == "prefill" else (self.dst_pool, self.dst_count)
        have = cells.get(pool)
        need = int(where[-1]) + 1
        unit = "state slot" if self.kind == "state" else "pages"
        if have is None or len(have) < need:
            raise PlanError(
                f"{role} gave {0 if have is None else len(have)} {unit} for pool {pool!r} "
                f"(layer {self.layer}), the request needs {need}"
            )
        picked = np.asarray(have, dtype=np.int64)[where]
        if picked.min() < 1 or picked.max() >= count:
            i = int(np.argmax((picked < 1) | (picked >= count)))
            what = "a tombstone (not resident)" if picked[i] == -1 else f"outside [1, {count})"
            raise PlanError(
                f"{role} cell {picked[i]} for position {where[i]} of pool {pool!r} (layer {self.layer}) is {what}"
            )
        return picked


class Route:
    """Everything about one (prefill rank, decode rank) pairing that no request changes.

    Built once per connection (pairs, TP pieces, chunk offsets grouped by pool); ``plan``
    then costs a few array operations per pool, whatever the number of layers.
    """

    def __init__(self, prefill: BufferSet, decode: BufferSet, pairs: Sequence[EntryPair]) -> None:
        self.prefill, self.decode = prefill, decode
        parts: dict[tuple, list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]] = {}
        for pair in pairs:
            a, b = prefill.entries[pair.src], decode.entries[pair.dst]
            where = f"{prefill.describe('prefill')} -> {decode.describe('decode')} layer {pair.layer_id}"
            total = a.shard_total if a.shard_dim is not None else None
            pieces = source_pieces(
                total, prefill.tp_size, a.shard_len, b.shard_start, b.shard_len, decode.tp_rank, where
            )
            key = (a.pool, b.pool, b.kind, b.window, b.page_size, a.stride, b.stride, a.count, b.count)
            for piece in pieces:
                if piece.src_rank == prefill.tp_rank:
                    s_off, d_off, ln = _item_chunks(a, b, piece.start, piece.end)
                    parts.setdefault(key, []).append((a.addr + s_off, b.addr + d_off, ln, pair.layer_id))
        self.groups = [
            _Group(
                *key[:5],
                *key[5:],
                layer=chunks[0][3],
                src_off=np.concatenate([c[0] for c in chunks]),
                dst_off=np.concatenate([c[1] for c in chunks]),
                length=np.concatenate([c[2] for c in chunks]),
            )
            for key, chunks in parts.items()
        ]

    def plan(
        self,
        seq_len: int,
        src_cells: Mapping[str, np.ndarray] | None,
        dst_cells: Mapping[str, np.ndarray],
    ) -> TransferPlan:
        """The ops of one request; ``src_cells=None`` gives a destination-only plan."""
        if seq_len < 1:
            raise PlanError(f"seq_len must be >= 1, got {seq_len}")
        src_parts, dst_parts, len_parts = [], [], []
        for g in self.groups:
            where = positions(g.kind, g.window, g.page_size, seq_len)
            if where.size == 0:
                continue
            d = g.cells(dst_cells, "decode", where)
            dst_parts.append((d[:, None] * g.dst_stride + g.dst_off).ravel())
            len_parts.append(np.tile(g.length, where.size))
            if src_cells is not None:
                s = g.cells(src_cells, "prefill", where)
                src_parts.append((s[:, None] * g.src_stride + g.src_off).ravel())
        dst = np.concatenate(dst_parts) if dst_parts else _EMPTY
        length = np.concatenate(len_parts) if len_parts else _EMPTY
        src = np.concatenate(src_parts) if src_parts else np.zeros_like(dst)
        _check_inside(dst, length, self.decode, "decode")
        if src_cells is not None:
            _check_inside(src, length, self.prefill, "prefill")
        return _coalesce(src, dst, length, merge_src=src_cells is not None)


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
    Engines that plan many requests keep a ``Route`` instead.
    """
    return Route(prefill, decode, pairs).plan(seq_len, src_cells, dst_cells)


def _check_inside(addr: np.ndarray, length: np.ndarray, bufs: BufferSet, role: str) -> None:
    if addr.size == 0:
        return
    lo, hi = int(addr.min()), int((addr + length).max())
    if any(start <= lo and hi <= start + size for start, size in bufs.regions):
        return  # all inside one region: the common case, two reductions
    inside = np.zeros(addr.size, dtype=bool)
    for start, size in bufs.regions:
        inside |= (addr >= start) & (addr + length <= start + size)
    if not inside.all():
        i = int(np.argmax(~inside))
        raise PlanError(
            f"range [{addr[i]:#x}, {addr[i] + length[i]:#x}) lies outside every region "
            f"{bufs.describe(role)} registered ({[(hex(a), n) for a, n in bufs.regions]})"
        )


def _coalesce(src: np.ndarray, dst: np.ndarray, length: np.ndarray, merge_src: bool) -> TransferPlan:
    pieces = int(dst.size)
    if pieces == 0:
        return TransferPlan(_EMPTY, _EMPTY, _EMPTY, 0)
    if pieces > 1 and not (dst[1:] > dst[:-1]).all():
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
