"""Transfer plans: a request's pages and slot -> coalesced ``(src, dst, length)`` arrays.

A plan is computed on the host from layouts (``BufferSet``), entry pairs and host cell ids
(``UnifiedMemory.host_cells``); it never reads a device tensor.

Invariants:
- An entry sends what its pool id's history rule keeps for a continuation at ``seq_len``
  (``PoolId.page_span``): every page for full-history pools (full, MLA), only the pages
  holding tokens ``[first_needed(seq_len), seq_len)`` for pools that release history
  (sliding windows), one slot for slot pools (recurrent state).
- When TP sizes differ, each item is cut along its sharded dimension into the pieces this
  prefill rank supplies (``slicing.source_pieces``); every decode byte has one source.
- Every cell id lies in ``[1, count)`` (0 is the padding sink, -1 a tombstone), every
  source range in what prefill registered and every destination range in what decode
  registered; no two destination ranges overlap; the cells name only pools the side's
  layout has (an unknown pool is refused, never ignored). Any violation raises
  ``PlanError`` before a byte moves; the destination side is checked first (both builders),
  so one fault gives one message whichever builder or path finds it.
- Ops are sorted by destination and maximal: adjacent pieces contiguous on both sides are
  merged, so the number of ops equals the number of contiguous runs. A destination-only
  plan (no source cells: what decode computes to verify checksums) merges on the
  destination alone; its byte order is the same as the full plan's.

Cost (what keeps a small request cheap): a ``Route`` does once per rank pair whatever no
request changes, including merging the chunks of one item that are contiguous on both
sides (a packed cell of all of a pool's layers becomes one chunk). A request's cell ids
are checked once per side, which also bounds every op's address (``Bounds``: cell range x
stride + the item's chunk extremes), so the region check reads the bounds instead of the
ops whenever they fall in one region, and transports check the bounds instead of
reducing the op arrays again. Plans of up to ``SMALL_PLAN`` pieces are built with Python
lists (numpy's fixed cost per call, paid again and again on caches a copy just flushed,
dominated them), larger ones with numpy arrays; tests hold both builders to the same ops.

Prepared plans: a plan splits into what the destination cells decide and what the source
cells add. ``Route.prepare`` does the first when the decode rank's request arrives (a
prefill rank is asked before its forward ends): the destination's checks, addresses, order
(by destination address), overlap refusal and where pieces are contiguous on the
destination; ``Route.complete`` then does only the source side on the critical path after
the forward: its checks, its addresses put in destination order, the merge of pieces
contiguous on both sides. ``plan`` is exactly ``complete(prepare(...))``; a ``Destination``
is read-only and completes any number of plans.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import IdSpace, PoolId
from hybridkv.transfer.buffers import BufferEntry, BufferSet, Role
from hybridkv.transfer.errors import PlanError
from hybridkv.transfer.ops import Bounds, Ops, TransferPlan, coalesce, overlap
from hybridkv.transfer.pairing import EntryPair
from hybridkv.transfer.slicing import source_pieces

_EMPTY = np.empty(0, dtype=np.int64)
SMALL_PLAN = 128
"""Plans of at most this many pieces (after merging within items) are built with Python
lists: below it, numpy's fixed cost per call outweighs its speed per element."""


def num_pages(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def page_span(pool: PoolId, page_size: int, seq_len: int) -> tuple[int, int]:
    """Positions ``[first, end)`` an entry of ``pool`` sends: page indices within the
    request (the pool's rule), or the request's one slot (position 0) in a slot pool."""
    if pool.id_space is IdSpace.SLOT:
        return 0, 1
    return pool.page_span(seq_len, page_size)


def memory_cells(mem: UnifiedMemory, pages: np.ndarray, slot: int | None) -> dict[str, np.ndarray]:
    """Host cell ids of a request in every pool of ``mem`` (tombstones stay -1), keyed by
    the entries' ``pool`` (``str(PoolId)``)."""
    out = {}
    for pool_id, pool in mem.pools.items():
        if pool.layout.id_space is IdSpace.SLOT:
            out[str(pool_id)] = mem.host_cells([slot], pool_id) if slot is not None else _EMPTY
        else:
            out[str(pool_id)] = mem.host_cells(pages, pool_id)
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
        self.items = list(zip(src_off.tolist(), dst_off.tolist(), length.tolist(), strict=True))
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
    rule: PoolId  # the destination pool's id: its history rule picks the positions sent
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

    def _picked(self, cells: Mapping[str, Ops], role: Role, first: int, end: int) -> tuple[Ops, str, int]:
        """The request's cells at positions ``[first, end)`` of this group's pool on one side."""
        pool, count = (self.src_pool, self.src_count) if role is Role.PREFILL else (self.dst_pool, self.dst_count)
        have = cells.get(pool)
        if have is None or len(have) < end:
            unit = "state slot" if self.rule.id_space is IdSpace.SLOT else "pages"
            raise PlanError(
                f"{role} gave {0 if have is None else len(have)} {unit} for pool {pool!r} "
                f"(layer {self.layer}), the request needs {end}"
            )
        return have[first:end], pool, count

    def _refuse(self, role: Role, pool: str, count: int, position: int, cell: int) -> PlanError:
        what = "a tombstone (not resident)" if cell == -1 else f"outside [1, {count})"
        return PlanError(f"{role} cell {cell} for position {position} of pool {pool!r} (layer {self.layer}) is {what}")

    def cells(self, cells: Mapping[str, Ops], role: Role, first: int, end: int) -> tuple[np.ndarray, int, int]:
        """The cells at positions ``[first, end)`` on one side as an array, and the lowest and
        highest of them; ``PlanError`` unless all are in ``[1, count)``."""
        have, pool, count = self._picked(cells, role, first, end)
        picked = np.asarray(have, dtype=np.int64)
        lo, hi = int(np.minimum.reduce(picked)), int(np.maximum.reduce(picked))
        if lo < 1 or hi >= count:
            i = int(np.argmax((picked < 1) | (picked >= count)))
            raise self._refuse(role, pool, count, first + i, int(picked[i]))
        return picked, lo, hi

    def cell_list(self, cells: Mapping[str, Ops], role: Role, first: int, end: int) -> tuple[list[int], int, int]:
        """``cells`` as a list of ints (same checks, same errors)."""
        have, pool, count = self._picked(cells, role, first, end)
        picked = [int(c) for c in have] if not isinstance(have, np.ndarray) else have.tolist()
        lo, hi = min(picked), max(picked)
        if lo < 1 or hi >= count:
            i = next(i for i, c in enumerate(picked) if not 1 <= c < count)
            raise self._refuse(role, pool, count, first + i, picked[i])
        return picked, lo, hi


def _addresses(cells: np.ndarray, stride: int, off: np.ndarray, lo: int) -> np.ndarray:
    """Address of every chunk of every cell, cell-major (``lo``: the lowest offset)."""
    out = cells * stride
    if off.size == 1:
        out += lo
        return out
    return (out[:, None] + off).ravel()


class Destination:
    """The destination side of one request's plan (``Route.prepare``), for ``Route.complete``.

    Holds, for plans of at most ``SMALL_PLAN`` pieces: the destination pieces checked, sorted
    and refused if they overlap (``dst``, ``length``), the permutation from work order to
    destination order (``order``; None when already sorted), where a piece continues the
    previous one on the destination (``joined``, and those pieces' indices: ``joins``; only
    there can two pieces merge), and the destination bounds. Read-only once prepared: plans
    may share its lists (they never write them); one ``Destination`` may complete any number
    of plans, on any thread.
    """

    __slots__ = (
        "bounds",
        "cells",
        "dst",
        "full",
        "joined",
        "joins",
        "length",
        "min_len",
        "nbytes",
        "order",
        "piece_len",
        "pieces",
        "seq_len",
        "src_work",
        "src_zeros",
        "work",
    )

    def __init__(
        self, seq_len: int, full: bool, work: list[tuple[_Group, _Chunks, int, int]], pieces: int, nbytes: int
    ) -> None:
        self.seq_len, self.full, self.work, self.pieces, self.nbytes = seq_len, full, work, pieces, nbytes
        self.cells: Mapping[str, Ops] | None = None  # large plans: the cells, for the array builder
        self.min_len = 0
        self.dst: list[int] = []  # per piece (merged pieces for a destination-only plan), ascending
        self.length: list[int] = []
        self.src_zeros: list[int] = []  # a destination-only plan's sources
        self.piece_len: list[int] = []  # per piece in work order (region errors)
        self.order: list[int] | None = None
        self.joined: list[bool] = []
        self.bounds = Bounds(0, 0, 0, 0, 0)  # source bounds come with the source
        self.src_work: list[tuple[_Group, str, int, int, int, int, list[int], int, int]] = []
        self.joins: list[int] = []  # the pieces ``joined`` marks


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
            where = f"{prefill.describe(Role.PREFILL)} -> {decode.describe(Role.DECODE)} layer {pair.layer_id}"
            total = a.shard_total if a.shard_dim is not None else None
            pieces = source_pieces(
                total, prefill.tp_size, a.shard_len, b.shard_start, b.shard_len, decode.tp_rank, where
            )
            key = (a.pool, b.pool, b.pool_id, b.page_size, a.stride, b.stride, a.count, b.count)
            for piece in pieces:
                if piece.src_rank == prefill.tp_rank:
                    s_off, d_off, ln = _item_chunks(a, b, piece.start, piece.end)
                    parts.setdefault(key, []).append((a.addr + s_off, b.addr + d_off, ln, pair.layer_id))
        start, size = prefill.regions[0] if prefill.regions else (0, 0)
        self._src_lo, self._src_hi = start, start + size  # the first source region: where bounds usually lie
        self.pools = {Role.PREFILL: frozenset(e.pool for e in prefill.entries)}
        self.pools[Role.DECODE] = frozenset(e.pool for e in decode.entries)
        self._src_pools = self.pools[Role.PREFILL]  # read per request: no enum hash on the critical path
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
        src_cells: Mapping[str, Ops] | None,
        dst_cells: Mapping[str, Ops],
    ) -> TransferPlan:
        """The ops of one request; ``src_cells=None`` gives a destination-only plan.

        The same as ``complete(prepare(seq_len, dst_cells, src_cells is not None), src_cells)``:
        plans of at most ``SMALL_PLAN`` pieces are built with Python lists, larger ones with
        numpy arrays; both apply the same checks and give the same ops.
        """
        return self.complete(self.prepare(seq_len, dst_cells, src_cells is not None), src_cells)

    def prepare(self, seq_len: int, dst_cells: Mapping[str, Ops], full: bool = True) -> Destination:
        """The destination side of a request's plan, checked and laid out before its source
        cells exist (a prefill rank prepares when the decode rank's request arrives, while its
        forward still runs); ``complete`` then adds the source side. ``full=False``: for a
        destination-only plan.

        Checks here, before any source is known: ``seq_len``, the destination's pools, cells
        (``[1, count)``), regions and overlaps; ``PlanError`` as ``plan`` raises them. Plans of
        more than ``SMALL_PLAN`` pieces are only checked for their pools here (the array
        builder does the rest in ``complete``).
        """
        if seq_len < 1:
            raise PlanError(f"seq_len must be >= 1, got {seq_len}")
        self._check_pools(dst_cells, Role.DECODE)
        work: list[tuple[_Group, _Chunks, int, int]] = []
        size = pieces = nbytes = 0
        min_len = 1 << 63
        for g in self.groups:
            first, end = page_span(g.rule, g.page_size, seq_len)
            if first < end:
                chunks = g.full if full else g.dst_only
                work.append((g, chunks, first, end))
                size += (end - first) * len(chunks.items)
                pieces += (end - first) * g.pieces
                nbytes += (end - first) * g.item_bytes
                min_len = min(min_len, chunks.min_len)
        dest = Destination(seq_len, full, work, pieces, nbytes)
        if not work:
            dest.dst = dest.length = dest.src_zeros = []
            dest.bounds = Bounds(0, 0, 0, 0, 0)
            return dest
        if size > SMALL_PLAN:
            dest.cells = dst_cells  # the array builder checks them in ``complete``
            dest.min_len = min_len
            return dest
        d_all: list[int] = []  # per piece, in work order (group, cell position, chunk)
        n_all: list[int] = []
        d_lo, d_hi = 1 << 63, 0
        for g, chunks, first, end in work:
            cells, lo, hi = g.cell_list(dst_cells, Role.DECODE, first, end)
            ds = g.dst_stride
            d_lo, d_hi = min(d_lo, lo * ds + chunks.dst_lo), max(d_hi, hi * ds + chunks.dst_hi)
            if len(chunks.items) == 1:
                ((_, b, n),) = chunks.items
                d_all += [d * ds + b for d in cells]
                n_all += [n] * len(cells)
            else:
                d_all += [d * ds + b for d in cells for _, b, _ in chunks.items]
                n_all += [n for _ in cells for _, _, n in chunks.items]
        if not _one_region(d_lo, d_hi, self.decode):  # rare: check each piece, as the array path does
            _check_inside(np.array(d_all, np.int64), np.array(n_all, np.int64), d_lo, d_hi, self.decode, Role.DECODE)
        order: list[int] | None = None
        d_sorted, n_sorted = d_all, n_all
        joined: list[bool] = []  # piece i continues piece i - 1 on the destination
        end_d = -1
        for d, n in zip(d_all, n_all, strict=True):  # pages allocated in order need no sort
            if d < end_d:
                break
            joined.append(d == end_d)
            end_d = d + n
        if len(joined) < len(d_all):  # out of order (or overlapping): sort, then refuse overlaps
            order = sorted(range(len(d_all)), key=d_all.__getitem__)
            d_sorted, n_sorted = [d_all[i] for i in order], [n_all[i] for i in order]
            joined, end_d = [], -1
            for d, n in zip(d_sorted, n_sorted, strict=True):
                if d < end_d:
                    raise overlap(d)
                joined.append(d == end_d)
                end_d = d + n
        dest.bounds = Bounds(0, 0, d_lo, d_hi, min_len)
        dest.piece_len, dest.order = n_all, order
        if not full:  # merge on the destination alone: the plan is complete
            out_d: list[int] = []
            out_n: list[int] = []
            for d, n, j in zip(d_sorted, n_sorted, joined, strict=True):
                if j:
                    out_n[-1] += n
                else:
                    out_d.append(d)
                    out_n.append(n)
            dest.dst, dest.length, dest.src_zeros = out_d, out_n, [0] * len(out_d)
            return dest
        dest.dst, dest.length = d_sorted, n_sorted
        dest.joined = joined
        dest.joins = [i for i, j in enumerate(joined) if j]
        dest.src_work = [
            (
                g,
                g.src_pool,
                g.src_count,
                first,
                end,
                g.src_stride,
                [a for a, _, _ in chunks.items],
                chunks.src_lo,
                chunks.src_hi,
            )
            for g, chunks, first, end in work
        ]
        return dest

    def complete(self, dest: Destination, src_cells: Mapping[str, Ops] | None) -> TransferPlan:
        """The plan of a prepared request: ``dest`` (from ``prepare`` on this route) with its
        source cells (``None`` for a destination-only ``dest``). What is left of the work:
        the source's pools, cells and regions checked, its addresses in destination order,
        pieces contiguous on both sides merged. The same ops, counts and bounds as ``plan``.
        """
        if dest.full != (src_cells is not None):
            raise ValueError(f"a {'full' if dest.full else 'destination-only'} destination, source cells {src_cells}")
        if src_cells is not None and not self._src_pools.issuperset(src_cells):
            self._check_pools(src_cells, Role.PREFILL)  # raises, naming the pools
        if dest.cells is not None:  # a large plan: the array builder
            return self._array_plan(dest.work, src_cells, dest.cells, dest.pieces, dest.nbytes, dest.min_len)
        if src_cells is None or not dest.dst:
            return TransferPlan(dest.src_zeros, dest.dst, dest.length, dest.pieces, dest.nbytes, dest.bounds)
        s_all: list[int] = []
        s_lo, s_hi = 1 << 63, 0
        for g, pool, count, first, end, ss, offs, c_lo, c_hi in dest.src_work:
            have = src_cells.get(pool)
            if type(have) is np.ndarray and len(have) >= end:  # as ``send`` gives them: no call, no copy
                cells = (have if first == 0 and len(have) == end else have[first:end]).tolist()
                lo, hi = min(cells), max(cells)
                if lo < 1 or hi >= count:
                    g.cell_list(src_cells, Role.PREFILL, first, end)  # raises, naming the cell
            else:
                cells, lo, hi = g.cell_list(src_cells, Role.PREFILL, first, end)
            s_lo, s_hi = min(s_lo, lo * ss + c_lo), max(s_hi, hi * ss + c_hi)
            if len(offs) == 1:  # a loop, not a comprehension: no function made per request
                a = offs[0]
                add = s_all.append
                for s in cells:
                    add(s * ss + a)
            else:
                s_all += [s * ss + a for s in cells for a in offs]
        if not ((self._src_lo <= s_lo and s_hi <= self._src_hi) or _one_region(s_lo, s_hi, self.prefill)):
            # rare: check each piece, as the array path does
            s_arr, n_arr = np.array(s_all, np.int64), np.array(dest.piece_len, np.int64)
            _check_inside(s_arr, n_arr, s_lo, s_hi, self.prefill, Role.PREFILL)
        if dest.order is not None:
            s_all = [s_all[i] for i in dest.order]
        _, _, d_lo, d_hi, min_len = dest.bounds
        bounds = Bounds(s_lo, s_hi, d_lo, d_hi, min_len)
        length = dest.length
        for i in dest.joins:  # only where the destination joins can pieces merge
            if s_all[i] == s_all[i - 1] + length[i - 1]:
                break
        else:  # nothing merges
            return TransferPlan(s_all, dest.dst, length, dest.pieces, dest.nbytes, bounds)
        out_s: list[int] = []
        out_d: list[int] = []
        out_n: list[int] = []
        end_s = -1
        for s, d, n, j in zip(s_all, dest.dst, length, dest.joined, strict=True):
            if j and s == end_s:  # contiguous on both sides
                out_n[-1] += n
            else:
                out_s.append(s)
                out_d.append(d)
                out_n.append(n)
            end_s = s + n
        return TransferPlan(out_s, out_d, out_n, dest.pieces, dest.nbytes, bounds)

    def _check_pools(self, cells: Mapping[str, Ops], role: Role) -> None:
        known = self.pools[role]
        if not known.issuperset(cells):
            unknown = sorted(set(cells) - known)
            bufs = self.prefill if role is Role.PREFILL else self.decode
            raise PlanError(
                f"{bufs.describe(role)}: the request's cells name pool(s) {unknown} it does not have; "
                f"known pools: {sorted(known)}"
            )

    def _array_plan(
        self,
        work: list[tuple[_Group, _Chunks, int, int]],
        src_cells: Mapping[str, Ops] | None,
        dst_cells: Mapping[str, Ops],
        pieces: int,
        nbytes: int,
        min_len: int,
    ) -> TransferPlan:
        src_parts, dst_parts, len_parts = [], [], []
        s_lo = d_lo = 1 << 63
        s_hi = d_hi = 0
        for g, chunks, first, end in work:  # the destination first, as ``prepare``
            cells, lo, hi = g.cells(dst_cells, Role.DECODE, first, end)
            dst_parts.append(_addresses(cells, g.dst_stride, chunks.dst_off, chunks.dst_lo))
            d_lo, d_hi = min(d_lo, lo * g.dst_stride + chunks.dst_lo), max(d_hi, hi * g.dst_stride + chunks.dst_hi)
            len_parts.append(chunks.lengths(end - first))
        dst, length = _joined(dst_parts), _joined(len_parts)
        _check_inside(dst, length, d_lo, d_hi, self.decode, Role.DECODE)
        for g, chunks, first, end in work:
            if src_cells is None:
                break
            cells, lo, hi = g.cells(src_cells, Role.PREFILL, first, end)
            src_parts.append(_addresses(cells, g.src_stride, chunks.src_off, chunks.src_lo))
            s_lo, s_hi = min(s_lo, lo * g.src_stride + chunks.src_lo), max(s_hi, hi * g.src_stride + chunks.src_hi)
        if src_cells is not None:
            src = _joined(src_parts)
            _check_inside(src, length, s_lo, s_hi, self.prefill, Role.PREFILL)
        else:
            src, s_lo, s_hi = np.zeros_like(dst), 0, 0
        bounds = Bounds(s_lo, s_hi, d_lo, d_hi, min_len)
        return coalesce(src, dst, length, src_cells is not None, pieces, nbytes, bounds)


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


def _one_region(lo: int, hi: int, bufs: BufferSet) -> bool:
    """``[lo, hi)`` lies inside one region ``bufs`` registered."""
    for start, size in bufs.regions:  # noqa: SIM110 (a loop, not any(<generator>): this runs per request)
        if start <= lo and hi <= start + size:
            return True
    return False


def _check_inside(addr: np.ndarray, length: np.ndarray, lo: int, hi: int, bufs: BufferSet, role: Role) -> None:
    """Every range ``[addr[i], addr[i] + length[i])``, all within ``[lo, hi)``, lies inside
    one region ``bufs`` registered."""
    if _one_region(lo, hi, bufs):
        return  # the common case, decided by the bounds alone
    inside = np.zeros(addr.size, dtype=bool)
    for start, size in bufs.regions:
        inside |= (addr >= start) & (addr + length <= start + size)
    if not inside.all():
        i = int(np.argmax(~inside))
        raise PlanError(
            f"range [{addr[i]:#x}, {addr[i] + length[i]:#x}) lies outside every region "
            f"{bufs.describe(role)} registered ({[(hex(a), n) for a, n in bufs.regions]})"
        )
