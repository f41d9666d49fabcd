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

Cost (what keeps a small request cheap): a ``Route`` does once per rank pair whatever no
request changes, including merging the chunks of one item that are contiguous on both
sides (a packed cell of all of a pool's layers becomes one chunk). A request then costs a
few array operations per pool: its cell ids are checked with two reductions per side,
which also bound every op's address (``Bounds``: cell range x stride + the item's chunk
extremes), so the region check reads the bounds instead of the ops whenever they fall in
one region, and transports check the bounds instead of reducing the op arrays again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hybridkv.memory import UnifiedMemory
from hybridkv.transfer.buffers import BufferEntry, BufferSet
from hybridkv.transfer.errors import PlanError
from hybridkv.transfer.pairing import EntryPair
from hybridkv.transfer.slicing import source_pieces

_EMPTY = np.empty(0, dtype=np.int64)


class Bounds(NamedTuple):
    """What holds for every op: its source lies in ``[src_lo, src_hi)``, its destination in
    ``[dst_lo, dst_hi)``, and it is at least ``min_len`` bytes long."""

    src_lo: int
    src_hi: int
    dst_lo: int
    dst_hi: int
    min_len: int


@dataclass(frozen=True)
class TransferPlan:
    src: np.ndarray  # int64 source addresses (prefill); zeros in a destination-only plan
    dst: np.ndarray  # int64 destination addresses (decode), ascending
    length: np.ndarray  # int64 bytes per op
    pieces: int  # elementary pieces before coalescing
    nbytes: int  # sum of ``length``
    bounds: Bounds  # derived from the checked cell ids, not from the op arrays

    @property
    def num_ops(self) -> int:
        return int(self.dst.size)

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


def page_span(kind: str, window: int | None, page_size: int, seq_len: int) -> tuple[int, int]:
    """Positions ``[first, end)`` an entry sends: page indices within the request, or the
    state slot (position 0)."""
    if kind == "state":
        return 0, 1
    first = max(0, seq_len - window) // page_size if window else 0
    return first, num_pages(seq_len, page_size)


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


class _Chunks:
    """The byte ranges one item of a group sends, as addresses of item 0's chunks (item
    ``c``: add ``c * stride``)."""

    def __init__(self, src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray) -> None:
        self.src_off, self.dst_off, self.length = src_off, dst_off, length
        # lowest start and highest end of item 0's chunks, per side (item c: add c * stride)
        self.src_lo, self.src_hi = int(src_off.min()), int((src_off + length).max())
        self.dst_lo, self.dst_hi = int(dst_off.min()), int((dst_off + length).max())
        self.min_len = int(length.min())  # merging pieces only makes ops longer
        self._lengths = length.copy()  # ``length`` repeated, grown on demand; plans get read-only views
        self._lengths.flags.writeable = False

    def lengths(self, items: int) -> np.ndarray:
        """``length`` repeated for ``items`` items (a read-only view). Safe on several
        threads: a racing grow only replaces the cache with an equal, longer array."""
        need = items * self.length.size
        if self._lengths.size < need:
            tiled = np.tile(self.length, max(items, 2 * self._lengths.size // self.length.size))
            tiled.flags.writeable = False
            self._lengths = tiled
        return self._lengths[:need]


def _merged(src: np.ndarray, dst: np.ndarray, length: np.ndarray, merge_src: bool) -> _Chunks:
    """Chunks sorted by destination, adjacent ones merged where contiguous (on both sides
    with ``merge_src``, else on the destination alone)."""
    order = np.argsort(dst, kind="stable")
    src, dst, length = src[order], dst[order], length[order]
    joined = dst[:-1] + length[:-1] == dst[1:]
    if merge_src:
        joined &= src[:-1] + length[:-1] == src[1:]
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    return _Chunks(src[starts], dst[starts], np.add.reduceat(length, starts))


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
    full: _Chunks  # merged on both sides: what a full plan sends per item
    dst_only: _Chunks  # merged on the destination: what a destination-only plan expects
    pieces: int  # elementary pieces per item, before any merge
    item_bytes: int  # bytes per item

    def cells(self, cells: Mapping[str, np.ndarray], role: str, first: int, end: int) -> tuple[np.ndarray, int, int]:
        """The request's cells at positions ``[first, end)`` of this group's pool on one
        side, and the lowest and highest of them; ``PlanError`` unless all are in ``[1, count)``."""
        pool, count = (self.src_pool, self.src_count) if role == "prefill" else (self.dst_pool, self.dst_count)
        have = cells.get(pool)
        unit = "state slot" if self.kind == "state" else "pages"
        if have is None or len(have) < end:
            raise PlanError(
                f"{role} gave {0 if have is None else len(have)} {unit} for pool {pool!r} "
                f"(layer {self.layer}), the request needs {end}"
            )
        picked = np.asarray(have, dtype=np.int64)[first:end]
        lo, hi = int(np.minimum.reduce(picked)), int(np.maximum.reduce(picked))
        if lo < 1 or hi >= count:
            i = int(np.argmax((picked < 1) | (picked >= count)))
            what = "a tombstone (not resident)" if picked[i] == -1 else f"outside [1, {count})"
            raise PlanError(
                f"{role} cell {picked[i]} for position {first + i} of pool {pool!r} (layer {self.layer}) is {what}"
            )
        return picked, lo, hi


def _addresses(cells: np.ndarray, stride: int, off: np.ndarray, lo: int) -> np.ndarray:
    """Address of every chunk of every cell, cell-major (``lo``: the lowest offset)."""
    out = cells * stride
    if off.size == 1:
        out += lo
        return out
    return (out[:, None] + off).ravel()


class Route:
    """Everything about one (prefill rank, decode rank) pairing that no request changes.

    Built once per connection (pairs, TP pieces, chunk offsets grouped by pool and merged
    within an item); ``plan`` then costs a few array operations per pool, whatever the
    number of layers. ``plan`` may run on several threads.
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
        self.groups: list[_Group] = []
        for key, chunks in parts.items():
            src = np.concatenate([c[0] for c in chunks])
            dst = np.concatenate([c[1] for c in chunks])
            length = np.concatenate([c[2] for c in chunks])
            full = _merged(src, dst, length, merge_src=True)
            self.groups.append(
                _Group(
                    *key,
                    layer=chunks[0][3],
                    full=full,
                    dst_only=_merged(src, dst, length, merge_src=False),
                    pieces=int(length.size),
                    item_bytes=int(length.sum()),
                )
            )

    def plan(
        self,
        seq_len: int,
        src_cells: Mapping[str, np.ndarray] | None,
        dst_cells: Mapping[str, np.ndarray],
    ) -> TransferPlan:
        """The ops of one request; ``src_cells=None`` gives a destination-only plan."""
        if seq_len < 1:
            raise PlanError(f"seq_len must be >= 1, got {seq_len}")
        full = src_cells is not None
        src_parts, dst_parts, len_parts = [], [], []
        pieces = nbytes = 0
        s_lo = d_lo = min_len = 1 << 63
        s_hi = d_hi = 0
        for g in self.groups:
            first, end = page_span(g.kind, g.window, g.page_size, seq_len)
            if first >= end:
                continue
            chunks = g.full if full else g.dst_only
            cells, lo, hi = g.cells(dst_cells, "decode", first, end)
            dst_parts.append(_addresses(cells, g.dst_stride, chunks.dst_off, chunks.dst_lo))
            d_lo, d_hi = min(d_lo, lo * g.dst_stride + chunks.dst_lo), max(d_hi, hi * g.dst_stride + chunks.dst_hi)
            if src_cells is not None:
                cells, lo, hi = g.cells(src_cells, "prefill", first, end)
                src_parts.append(_addresses(cells, g.src_stride, chunks.src_off, chunks.src_lo))
                s_lo, s_hi = min(s_lo, lo * g.src_stride + chunks.src_lo), max(s_hi, hi * g.src_stride + chunks.src_hi)
            len_parts.append(chunks.lengths(end - first))
            min_len = min(min_len, chunks.min_len)
            pieces += (end - first) * g.pieces
            nbytes += (end - first) * g.item_bytes
        if not dst_parts:
            return TransferPlan(_EMPTY, _EMPTY, _EMPTY, 0, 0, Bounds(0, 0, 0, 0, 0))
        dst, length = _joined(dst_parts), _joined(len_parts)
        _check_inside(dst, length, d_lo, d_hi, self.decode, "decode")
        if full:
            src = _joined(src_parts)
            _check_inside(src, length, s_lo, s_hi, self.prefill, "prefill")
        else:
            src, s_lo, s_hi = np.zeros_like(dst), 0, 0
        return _coalesce(src, dst, length, full, pieces, nbytes, Bounds(s_lo, s_hi, d_lo, d_hi, min_len))


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


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


def _check_inside(addr: np.ndarray, length: np.ndarray, lo: int, hi: int, bufs: BufferSet, role: str) -> None:
    """Every range ``[addr[i], addr[i] + length[i])``, all within ``[lo, hi)``, lies inside
    one region ``bufs`` registered."""
    if any(start <= lo and hi <= start + size for start, size in bufs.regions):
        return  # all inside one region: the common case, decided by the bounds alone
    inside = np.zeros(addr.size, dtype=bool)
    for start, size in bufs.regions:
        inside |= (addr >= start) & (addr + length <= start + size)
    if not inside.all():
        i = int(np.argmax(~inside))
        raise PlanError(
            f"range [{addr[i]:#x}, {addr[i] + length[i]:#x}) lies outside every region "
            f"{bufs.describe(role)} registered ({[(hex(a), n) for a, n in bufs.regions]})"
        )


def _coalesce(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, merge_src: bool, pieces: int, nbytes: int, bounds: Bounds
) -> TransferPlan:
    """Sort by destination (unless sorted), refuse overlaps, merge contiguous runs.

    Lengths are positive, so non-negative gaps between consecutive pieces mean "sorted and
    disjoint": one reduction decides whether a sort is needed at all, and a smallest gap
    above zero means nothing can merge.
    """
    if dst.size > 1:
        end = dst + length
        gap = dst[1:] - end[:-1]
        smallest = np.minimum.reduce(gap)
        if smallest < 0:  # unsorted, or overlapping
            order = np.argsort(dst, kind="stable")
            src, dst, length = src[order], dst[order], length[order]
            end = dst + length
            gap = dst[1:] - end[:-1]
            smallest = np.minimum.reduce(gap)
            if smallest < 0:
                i = int(np.argmax(gap < 0))
                raise PlanError(
                    f"two pieces write the same decode bytes at {dst[i + 1]:#x} (a page or slot given "
                    "twice in the request's destination cells?)"
                )
        if smallest == 0:
            joined = gap == 0
            if merge_src:
                joined &= src[:-1] + length[:-1] == src[1:]
            if np.logical_or.reduce(joined):
                starts = np.flatnonzero(np.concatenate(([True], ~joined)))
                src, dst, length = src[starts], dst[starts], np.add.reduceat(length, starts)
    return TransferPlan(src, dst, length, pieces, nbytes, bounds)
