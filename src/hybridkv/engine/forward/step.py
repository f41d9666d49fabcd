"""StepContext: one step's index tensors, masks and pool I/O, built once from a ForwardBatch.

Step order. A step lays its requests out decodes first (one new token each, longest context
first, equal ones in the batch's order), then the longer spans, longest first (equal lengths in
the batch's order); its flat tokens (``input_ids``, ``positions``, every hidden state of the
step) follow that order. ``logit_index[i]`` is the flat index of the batch's request ``i``'s last
new token, so logits come back in the batch's order; after those, the flat indices of every new token
of the batch's ``logit_rows`` (in their order), whose logits a prompt's log-probabilities need.
``groups`` are contiguous ranges of step rows and flat tokens, each padded to its own longest span:
the decodes (never padded to a chunk), then the longer spans cut where the padding saved is worth another group
(``span_groups``): a 4-token tail is not padded to the 64 tokens of the step's longest chunk.

Attention of a group reads, per token pool, the columns of its requests' pages from the page
of the earliest position a new token can see (``first_needed(prefix + 1)``, the pool id's
rule), plus one spare column when a layer needs it (``sinks``: attention sinks join the
softmax as that zero key). A group's rows are cut into parts (``key_parts``) each padded to
its own widest row (``KeyPart``): a 20-token context is not padded to a 270-token one. Every
part of every group is gathered at once per pool, for every layer of the pool (one buffer; a
window of layers at a time beyond the workspace, ``pool_io``); the step's new entries are put
in by each layer as it computes them (the pool gets them once, at the end of the step:
``flush``, or per layer when windowed). A bf16 or fp32 CPU pool of K/V plans its decode group as page
tables instead (``ops.paged_decode``: no gathered columns, no mask), and every row after it as one more
(``ops.paged_spans``: ``PagedRows`` with each row's query offsets, whatever the groups): such a pool gathers
nothing. Each part has one additive mask ``(R_p, 1, Q', W)``, built here: 0 where query ``q`` sees column ``c`` (causal,
the pool's history rule, e.g. a sliding window), ``-inf`` elsewhere (padding, slots after a
row's last token). State pools: every row's state cell is gathered once (``StateIO``) and
written back once (and copied into its reserved checkpoint cell, if the batch gives one).

Invariants:
- Physical ids come from one ``page_cells`` per pool and step (token pools: every group's
  pages at once; the new tokens' cells are taken from them), after every allocation of the
  step; they are valid for this step only (compaction may move cells between steps).
- Padded queries repeat their request's last real new token; every query sees at least its own
  key. Nothing here reads a device tensor on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.engine.forward.batch import ForwardBatch
from hybridkv.engine.forward.pool_io import KeyPart, StateIO, TokenIO, TokenLayout, pool_layouts
from hybridkv.engine.ops.paged_decode import PagedRows, pages_decodes
from hybridkv.engine.ops.paged_spans import pages_spans
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import PoolId

PartAttention = Callable[[torch.Tensor, KeyPart], torch.Tensor]
"""One key part's attention: its rows' padded queries and the part -> their outputs (see ``StepContext.attend``)."""
PagedAttention = Callable[[torch.Tensor, PagedRows], torch.Tensor]
"""Attention of some rows from the pool's pages: their queries ``(T, heads, D)`` -> outputs (``ops.paged_decode`` for
the decode group, ``ops.paged_spans`` for the rows after it)."""


@dataclass(frozen=True)
class Group:
    """Some of the step's requests (a contiguous range of rows and tokens) as a padded ``(R', Q')`` batch."""

    rows: slice  # step rows [a, b)
    tokens: slice  # flat tokens [a, b)
    width: int  # Q': the longest new span of the group
    lengths: torch.Tensor  # (R',) new tokens per row
    query_index: torch.Tensor | None  # (R', Q') flat index of each padded query; None when Q' = 1
    from_padded: torch.Tensor | None  # (T',) each token's row of the (R' * Q') layout; None when Q' = 1

    @property
    def decode_only(self) -> bool:
        """Every request of the group adds one token."""
        return self.width == 1

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Flat ``(T, ...)`` -> padded ``(R', Q', ...)``; padded rows repeat the last real token."""
        if self.query_index is None:
            return x[self.tokens].unsqueeze(1)
        # index_select: a row gather ~2.4x faster than indexing with the 2-D tensor (2048 x 4 x 128 bf16: 380 -> 160 µs)
        return x.index_select(0, self.query_index.reshape(-1)).view(*self.query_index.shape, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded ``(R', Q', ...)`` -> the group's flat ``(T', ...)``."""
        flat = x.reshape(-1, *x.shape[2:])
        return flat if self.from_padded is None else flat.index_select(0, self.from_padded)


@dataclass(frozen=True)
class StepContext:
    input_ids: torch.Tensor  # (T,) in step order
    positions: torch.Tensor  # (T,)
    logit_index: torch.Tensor  # (R [+ E],) flat index of each request's last new token, then of logit_rows' every one
    groups: tuple[Group, ...]  # decodes, then longer spans (or the one kind)
    tokens: dict[PoolId, TokenIO]  # per token pool
    states: dict[PoolId, StateIO]  # per state pool (stateful steps)
    pool_of: dict[int, PoolId]  # layer id -> its pool

    def token_io(self, layer_id: int) -> TokenIO:
        """The I/O of the token pool holding ``layer_id``'s entries."""
        return self.tokens[self.pool_of[layer_id]]

    def attend(
        self,
        io: TokenIO,
        q: torch.Tensor,
        part_attention: PartAttention,
        paged: PagedAttention | None = None,
        spans: PagedAttention | None = None,
    ) -> torch.Tensor:
        """Queries ``(T, heads, D)`` of the step's tokens attended per group and key part (``part_attention(queries
        (R_p, heads, Q', D), part) -> (R_p, heads, Q', D')``, queries padded per group) -> ``(T, heads, D')``; the
        decode group of a pool that reads it from its pages (``io.paged``) through ``paged(queries (R, heads, D),
        io.paged) -> (R, heads, D')``, and the rows after it, when the pool reads them from its pages too
        (``io.spans``), through ``spans(their queries (T', heads, D), io.spans)``."""
        outs = []
        for g, (group, parts) in enumerate(zip(self.groups, io.parts, strict=True)):
            if g == 0 and io.paged is not None:
                if paged is None:
                    raise ValueError(f"pool {io.layout.pool_id} reads its decodes from its pages: give paged attention")
                outs.append(paged(q[group.tokens], io.paged))
                continue
            if io.spans is not None:  # every row from here on, in one call
                if spans is None:
                    raise ValueError(f"pool {io.layout.pool_id} reads its spans from its pages: give span attention")
                outs.append(spans(q[group.tokens.start :], io.spans))
                break
            q_group = group.pad(q).transpose(1, 2)  # (R', heads, Q', D)
            done = [part_attention(q_group if len(parts) == 1 else q_group[p.rows], p) for p in parts]
            outs.append(group.unpad((done[0] if len(done) == 1 else torch.cat(done)).transpose(1, 2)))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def state_io(self, layer_id: int) -> StateIO:
        """The I/O of the state pool holding ``layer_id``'s state."""
        try:
            return self.states[self.pool_of[layer_id]]
        except KeyError:
            raise ValueError(f"layer {layer_id} keeps recurrent state: the step needs state slots") from None

    def flush(self) -> None:
        """Write the step's new K/V and updated states to their pools (once, after every layer ran; a windowed token
        pool stored each layer's as it wrote them)."""
        for io in self.tokens.values():
            io.flush()
        for state in self.states.values():
            state.flush()


def _arange_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n)`` without a Python loop."""
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total)


@dataclass(frozen=True)
class _Rows:
    """The step's requests in step order (host arrays)."""

    pre: np.ndarray
    ext: np.ndarray
    page_base: np.ndarray  # where each row's pages start in the step's page table
    tok_start: np.ndarray  # each row's first flat token (step order)


Dev = Callable[[np.ndarray], torch.Tensor]


def _group(rows: _Rows, a: int, b: int, dev: Dev) -> Group:
    ext, start = rows.ext[a:b], rows.tok_start[a:b]
    r, q = b - a, int(ext.max())
    query_index = from_padded = None
    if q > 1:
        query_index = dev(start[:, None] + np.minimum(np.arange(q), ext[:, None] - 1))
        from_padded = dev(np.repeat(np.arange(r) * q, ext) + _arange_runs(np.zeros(r, dtype=np.int64), ext))
    tokens = slice(int(start[0]), int(start[-1] + ext[-1]))
    return Group(slice(a, b), tokens, q, dev(ext), query_index, from_padded)


PART_COST = 7000
"""A key part's fixed cost (its per-layer attention call, slicing, concat: about 50 µs a layer on the tiny models) in
padded (query, key column) pairs, where one key column costs ``KEY_COLUMN_QUERIES`` pairs more (gathered, read)."""
KEY_COLUMN_QUERIES = 6


def padded_parts(sizes: Sequence[int], fixed: float) -> list[tuple[int, int]]:
    """Contiguous parts ``[a, b)`` of ``sizes``, each padded to its largest, that minimise the padded total
    (``items * largest`` summed over parts) plus ``fixed`` per part. Cuts fall only where the size changes (a part
    never gains by cutting a run of equal sizes), so the search is over runs: few for sorted sizes."""
    n = len(sizes)
    bounds = [i for i in range(n) if i == 0 or sizes[i] != sizes[i - 1]] + [n]
    run_size = [sizes[b] for b in bounds[:-1]]
    m = len(bounds) - 1
    best, cut = [0.0] * (m + 1), [0] * (m + 1)
    for j in range(1, m + 1):  # a hot loop (every step, per pool and group): plain comparisons, no tuples
        end, top, least, at = bounds[j], 0, float("inf"), 0
        for i in range(j - 1, -1, -1):  # the part [bounds[i], bounds[j]), its largest size so far
            if run_size[i] > top:
                top = run_size[i]
            cost = best[i] + fixed + (end - bounds[i]) * top
            if cost <= least:  # a tie goes to the longer part (the smaller i), as before
                least, at = cost, i
        best[j], cut[j] = least, at
    parts, j = [], m
    while j:
        parts.append((bounds[cut[j]], bounds[j]))
        j = cut[j]
    return parts[::-1]


def key_parts(widths: np.ndarray, queries: int, page_size: int) -> list[tuple[int, int]]:
    """Parts of a group's rows (``widths``: each row's key pages) for ``padded_parts``: a padded (query, key column)
    pair costs ``queries + KEY_COLUMN_QUERIES`` per row page, a part ``PART_COST``."""
    fixed = PART_COST / ((queries + KEY_COLUMN_QUERIES) * page_size)  # in row pages
    if widths.size * (int(widths.max()) - int(widths.min())) <= fixed:  # all the padding costs less than one more part
        return [(0, widths.size)]
    return padded_parts(widths.tolist(), fixed)


@dataclass(frozen=True)
class _PartPlan:
    """Some rows of a group and their keys in one token pool, on the host (see ``KeyPart``)."""

    rows: slice  # the group's rows
    width: int  # pages per row
    columns: slice  # its columns of the step's buffer
    mask: np.ndarray  # (R_p, 1, Q', W)
    spare: np.ndarray | None  # (R_p, 1, 1, W); None without a spare column


@dataclass(frozen=True)
class _PagedPlan:
    """Rows read from their pages (``PagedRows``), on the host."""

    virtual: np.ndarray  # (R * W,) each row's virtual page ids from its first visible page (0, the sink, after)
    width: int  # W
    start: np.ndarray
    stop: np.ndarray
    new_page: np.ndarray  # (T,) each new token's page, as a flat index into ``virtual``
    offset: np.ndarray  # (T,) and its slot in that page
    q_begin: np.ndarray  # (R + 1,) each row's first new token, counted from the rows' first


@dataclass(frozen=True)
class _PoolPlan:
    """The step's keys in one token pool, on the host."""

    virtual: list[np.ndarray]  # per gathered group: its rows' virtual page ids, flat (0, the sink, for padding pages)
    parts: list[list[_PartPlan]]  # per group (none for a paged one)
    new_cols: list[np.ndarray]  # per gathered group: each new token's buffer column
    zero_cols: list[np.ndarray]  # slots after each row's last token in its last page
    paged: _PagedPlan | None = None  # the decode group, when read from its pages
    spans: _PagedPlan | None = None  # every row after it, when read from their pages


def _paged_plan(rows: _Rows, a: int, b: int, pool_id: PoolId, table: np.ndarray, ps: int) -> _PagedPlan:
    """The rows ``[a, b)`` as page tables from each row's first visible page (that of its first new token)."""
    pre, ext = rows.pre[a:b], rows.ext[a:b]
    seq = pre + ext
    first = pool_id.first_needed(pre + 1) if pool_id.releases_history else np.zeros_like(seq)
    first_page = first // ps
    pages = -(-seq // ps) - first_page
    width = int(pages.max())
    col = np.arange(width)
    real = col[None, :] < pages[:, None]
    at_table = np.where(real, rows.page_base[a:b, None] + first_page[:, None] + col[None, :], 0)
    virtual = np.where(real, table[at_table], 0).reshape(-1)
    base = first_page * ps
    new_pos = _arange_runs(pre, ext)
    row = np.repeat(np.arange(b - a), ext)
    new_page = row * width + (new_pos - base[row]) // ps
    q_begin = np.concatenate(([0], np.cumsum(ext)))
    return _PagedPlan(virtual, width, first - base, seq - base, new_page, new_pos % ps, q_begin)


def _masks(
    pool_id: PoolId, pre: np.ndarray, ext: np.ndarray, base: np.ndarray, q: int, cols: int, sinks: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows' additive masks ``(R, 1, q, cols)`` over key positions ``base + c`` (what each of the ``q`` padded
    queries sees: causal, the pool's history rule; -inf past a row's last token), and (``sinks``) their spare
    columns ``(R, 1, 1, cols)``."""
    seq = pre + ext
    key_pos = base[:, None] + np.arange(cols)  # (R, W)
    if q == 1:  # one query per row, at seq - 1: it sees its whole history
        visible = key_pos < seq[:, None]
        if pool_id.releases_history:
            visible &= key_pos >= pool_id.first_needed(seq)[:, None]
        visible = visible[:, None, :]
    else:
        query_pos = pre[:, None] + np.minimum(np.arange(q), ext[:, None] - 1)  # (R, q)
        visible = (key_pos < seq[:, None])[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])
        if pool_id.releases_history:
            visible &= key_pos[:, None, :] >= pool_id.first_needed(query_pos + 1)[:, :, None]
    spare = None
    if sinks:
        spare = np.zeros((seq.size, 1, 1, cols), dtype=np.float32)
        spare[np.arange(seq.size), 0, 0, seq - base] = 1.0
    return np.where(visible, np.float32(0), np.float32(-np.inf))[:, None], spare


def _plan_pool(
    rows: _Rows,
    bounds: list[tuple[int, int]],
    pool_id: PoolId,
    table: np.ndarray,
    ps: int,
    sinks: bool,
    paged: bool,
    spans: bool,
) -> _PoolPlan:
    """Every group's keys in one token pool: per row, columns from the page of the earliest position a new token
    sees to its part's widest row's last token (``sinks``: to one spare column past it); ``paged``: the first group
    (the decodes) as page tables instead, ``spans``: every group after it as one (``_paged_plan``)."""
    n_dec = bounds[0][1] if paged else 0
    plan = _PoolPlan(
        [],
        [],
        [],
        [],
        _paged_plan(rows, 0, n_dec, pool_id, table, ps) if paged else None,
        _paged_plan(rows, bounds[int(paged)][0], bounds[-1][1], pool_id, table, ps) if spans else None,
    )
    if spans:
        plan.parts.extend([] for _ in bounds)
        return plan
    at = 0  # buffer columns so far
    for g, (a, b) in enumerate(bounds):
        if g == 0 and paged:
            plan.parts.append([])
            continue
        pre, ext = rows.pre[a:b], rows.ext[a:b]
        seq = pre + ext
        r, q = b - a, int(ext.max())
        first_page = pool_id.first_needed(pre + 1) // ps
        base = first_page * ps
        pages = -(-seq // ps) - first_page  # the row's pages from its first visible one
        need = -(-(seq - base + int(sinks)) // ps)  # pages it needs (a spare column past its last token)
        parts = key_parts(need, q, ps)
        row_width = np.empty(r, dtype=np.int64)
        group_parts = []
        # one query per row (decodes): the group's masks at its widest, each part's a slice (few wide arrays)
        whole = _masks(pool_id, pre, ext, base, q, int(need.max()) * ps, sinks) if q == 1 and len(parts) > 1 else None
        for i, j in parts:
            width = int(need[i:j].max())
            row_width[i:j] = width
            cols = width * ps
            if whole is None:
                mask, spare = _masks(pool_id, pre[i:j], ext[i:j], base[i:j], q, cols, sinks)
            else:
                mask, spare = whole[0][i:j, ..., :cols], None if whole[1] is None else whole[1][i:j, ..., :cols]
            group_parts.append(_PartPlan(slice(i, j), width, slice(at, at + (j - i) * cols), mask, spare))
            at += (j - i) * cols
        row_start = np.concatenate(([0], np.cumsum(row_width[:-1]))) * ps + group_parts[0].columns.start
        col = _arange_runs(np.zeros(r, dtype=np.int64), row_width)
        row = np.repeat(np.arange(r), row_width)
        real = col < pages[row]
        at_table = np.where(real, rows.page_base[a:b][row] + first_page[row] + col, 0)
        plan.virtual.append(np.where(real, table[at_table], 0))
        plan.parts.append(group_parts)
        plan.new_cols.append(np.repeat(row_start, ext) + _arange_runs(pre - base, ext))
        tail = (first_page + pages) * ps - seq  # slots after the row's last token in its last page
        plan.zero_cols.append(np.repeat(row_start, tail) + _arange_runs(seq - base, tail))
    return plan


def _token_io(layout: TokenLayout, plan: _PoolPlan, mem: UnifiedMemory, dev: Dev) -> TokenIO:
    """The pool's I/O for the step: one ``page_cells`` and one gather for every group's pages (of the first window of
    slots, when they are windowed)."""
    ps = mem.page_size
    empty = np.zeros(0, dtype=np.int64)
    gathered = sum(v.size for v in plan.virtual)
    read = [p for p in (plan.paged, plan.spans) if p is not None]  # the rows read from their pages
    every = mem.page_cells(np.concatenate(plan.virtual + [p.virtual for p in read]), layout.pool_id)
    cells = every[:gathered]
    zero_cols = dev(np.concatenate([empty, *plan.zero_cols]))
    if gathered:
        buffer = TokenIO.gather(layout, cells, zero_cols, slice(0, layout.window(cells.numel())))
    else:  # every row read from its pages: no keys to gather, no sink to zero (they read only their pages)
        buffer = layout.grid.new_empty((layout.slots, 0, *layout.grid.shape[3:]))
    shape = buffer.shape[2:]
    parts = [
        [
            KeyPart(
                buffer[:, p.columns].view(buffer.shape[0], p.rows.stop - p.rows.start, p.width * ps, *shape),
                p.rows,
                dev(p.mask),
                None if p.spare is None else dev(p.spare),
            )
            for p in group
        ]
        for group in plan.parts
    ]
    new_cols = np.concatenate([empty, *plan.new_cols])
    new_pages = dev(new_cols // ps)
    on_pages: list[PagedRows | None] = []
    at = gathered
    for p in (plan.paged, plan.spans):
        if p is None:
            on_pages.append(None)
            continue
        table = every[at : at + p.virtual.size]
        at += p.virtual.size
        on_pages.append(
            PagedRows(
                table.view(-1, p.width),
                dev(p.start),
                dev(p.stop),
                table[dev(p.new_page)],
                dev(p.offset),
                dev(p.q_begin),
            )
        )
    return TokenIO(
        layout, buffer, parts, dev(new_cols), cells[new_pages], dev(new_cols % ps), (cells, zero_cols), *on_pages
    )


SPLIT_ROWS = 64
"""A group's fixed cost in padded query rows (its per-layer attention call, padding, key gather and mask); on the
tiny models one padded query row costs about 11 µs per step (Gemma 3: attention over ~224 keys in 2 full layers
and ~96 in 4 sliding ones) and one more group about 0.7 ms."""


def span_groups(lengths: list[int]) -> list[tuple[int, int]]:
    """Groups of spans sorted longest first for ``padded_parts``: padded query rows, ``SPLIT_ROWS`` per group."""
    return padded_parts(lengths, SPLIT_ROWS)


def build_step(batch: ForwardBatch, mem: UnifiedMemory, device: torch.device, sinks: bool) -> StepContext:
    """The step's context for ``batch`` (``sinks``: give every group's keys the spare column attention sinks use)."""

    def dev(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if device.type == "cpu" else t.to(device, non_blocking=True)

    ps = mem.page_size
    ext_b, pre_b = batch.extend_lens, batch.prefix_lens
    table, page_base_b = batch.page_table(ps)
    decodes, longer = np.flatnonzero(ext_b == 1), np.flatnonzero(ext_b > 1)
    decodes = decodes[np.argsort(-pre_b[decodes], kind="stable")]  # widest keys first: parts of similar widths
    longer = longer[np.argsort(-ext_b[longer], kind="stable")]
    n_dec = decodes.size
    step_order = np.concatenate([decodes, longer])
    order = None if np.array_equal(step_order, np.arange(ext_b.size)) else step_order
    tok_base_b = np.cumsum(ext_b) - ext_b
    if order is None:
        pre, ext, page_base, tok_src = pre_b, ext_b, page_base_b, tok_base_b
    else:
        pre, ext, page_base, tok_src = pre_b[order], ext_b[order], page_base_b[order], tok_base_b[order]
    tok_start = np.cumsum(ext) - ext
    rows = _Rows(pre, ext, page_base, tok_start)
    positions = _arange_runs(pre, ext)
    input_ids = batch.input_ids if order is None else batch.input_ids[_arange_runs(tok_src, ext)]
    if order is None:
        last = tok_start + ext - 1
    else:
        last = np.empty_like(tok_start)
        last[order] = tok_start + ext - 1

    layouts = pool_layouts(mem)
    bounds = [(0, n_dec)] if n_dec else []
    bounds += [(n_dec + a, n_dec + b) for a, b in span_groups(ext[n_dec:].tolist())]
    groups = tuple(_group(rows, a, b, dev) for a, b in bounds)
    tokens = {}
    for pool_id, layout in layouts.tokens.items():
        names = {name for _, name in layout.slot}
        paged = n_dec > 0 and pages_decodes(layout.grid, names, sinks)
        spans = len(bounds) > int(n_dec > 0) and pages_spans(layout.grid, names, sinks, pool_id)
        plan = _plan_pool(rows, bounds, pool_id, table, ps, sinks, paged, spans)
        tokens[pool_id] = _token_io(layout, plan, mem, dev)
    states = {}
    if batch.state_slots is not None and batch.fresh_state is not None:
        slots_o = batch.state_slots if order is None else batch.state_slots[order]
        fresh_rows = np.flatnonzero(batch.fresh_state if order is None else batch.fresh_state[order])
        fresh = dev(fresh_rows) if fresh_rows.size else None
        ckpt = batch.checkpoint_slots
        if ckpt is not None and order is not None:
            ckpt = ckpt[order]
        ckpt_rows = np.flatnonzero(ckpt >= 0) if ckpt is not None else np.empty(0, dtype=np.int64)
        for pool_id, state_layout in layouts.states.items():
            copies = None
            if ckpt is not None and ckpt_rows.size:
                copies = (dev(ckpt_rows), mem.page_cells(ckpt[ckpt_rows], pool_id))
            states[pool_id] = StateIO(state_layout, mem.page_cells(slots_o, pool_id), fresh, copies)
    if batch.logit_rows is not None:  # every new token of these rows too, after the last ones
        rows_b = batch.logit_rows
        last = np.concatenate([last, _arange_runs(last[rows_b] - ext_b[rows_b] + 1, ext_b[rows_b])])
    return StepContext(
        input_ids=dev(input_ids),
        positions=dev(positions),
        logit_index=dev(last),
        groups=groups,
        tokens=tokens,
        states=states,
        pool_of=layouts.pool_of,
    )
