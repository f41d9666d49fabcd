"""Pool I/O of a step: one gather and one scatter per memory pool per step, not one per layer (one per window of
layers when a step's keys exceed the workspace).

A pool's cell holds an entry of every layer the pool serves (``memory.layout``). ``PoolLayouts``
reads that layout once per memory and exposes each pool as one tensor over the whole grid:
- a token pool as ``(cells, slots, page_size, *shape)``: every layer keeps the same number of
  same-shaped entries per token (K and V, or one MLA latent), its slots side by side;
- a state pool as raw cell bytes ``(cells, cell_bytes)``, with each (layer, tensor)'s byte
  range, dtype and per-request shape.

Per step, ``TokenIO`` gathers the context pages of every padded group of requests (cut into
parts of similar widths) for every layer of the pool at once (``index_select`` into one
buffer), puts each layer's new entries in with one indexed copy, and writes them all with
one indexed store at ``flush``; on the CPU with the C++ kernels (``ops.put_entries``), each layer's ``write`` copies its
new entries straight into the buffer's columns and the pool's pages instead (no stacked copy, no indexed stores into
strided views; ``flush`` then has nothing left to store).

The buffer is bounded: the token pools' buffers aim to take at most ``WORKSPACE_SHARE`` of the
memory budget together (``TokenLayout.workspace_bytes`` each). A step whose keys exceed it
gathers a window of slots at a time (``TokenLayout.window``: as many as fit, never fewer than one
layer's, so one layer's keys, padded, may exceed the bound): when a layer writes slots outside
the loaded window, the window is gathered again from there, and each layer's new entries go to
the pool at once (a later window reads them back).

A bf16 or fp32 CPU step whose pool keeps K/V reads its decode rows from the pool's pages instead
(``ops.paged_decode``, ``TokenIO.paged``), and the rows after them too (``ops.paged_spans``, ``TokenIO.spans``): they
take no buffer columns, and each layer puts their new entries in the pool at once, before it attends.

``StateIO`` gathers every request's state cell once (zeros where a state starts fresh), lets the
layers read and update typed views of it in place, and writes the cells back once at ``flush``; with
``fast_paths(state_cells=...)`` it gathers no whole cell: a layer may update its state in the pool by cell, and each
tensor read through a view is gathered alone and written back.

Invariants:
- A pool whose layers do not fit one uniform grid of slots, or whose named state tensors are
  not adjacent with one dtype, is refused with the layers and tensors named (``LayoutError``).
- Physical cells are the step's (valid for this step only); nothing here reads a device
  tensor on the host.
- A pool's step buffer never holds more than ``TokenLayout.window`` slots, and a layer reads its keys only
  through the slots ``TokenIO.write`` returns for it.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.cast import cast
from hybridkv.engine.ops.paged_decode import PagedRows
from hybridkv.engine.ops.put_entries import put_columns, put_pages, puts_entries
from hybridkv.memory import UnifiedMemory
from hybridkv.memory.pool import SubPool
from hybridkv.spec import IdSpace, PoolId

WORKSPACE_SHARE = 0.25
"""The most the token pools' step buffers take together, as a share of the memory budget (on top of it)."""


class LayoutError(ValueError):
    """A pool whose cell layout the step's one-gather I/O cannot address."""


@dataclass(frozen=True)
class TokenLayout:
    """One token pool: ``grid`` ``(cells, slots, page_size, *shape)``, ``slot[(layer, tensor)]`` its slot."""

    pool_id: PoolId
    grid: torch.Tensor
    slot: dict[tuple[int, str], int]
    workspace_bytes: int  # the most this pool's step buffer may take
    layer_slots: int  # the most slots one layer keeps (K and V: 2; an MLA latent: 1)
    spans: dict[tuple[int, tuple[str, ...]], slice] = field(default_factory=dict)
    _workspace: list[torch.Tensor] = field(default_factory=list)  # at most one buffer: the step's gathered keys

    @property
    def slots(self) -> int:
        return self.grid.shape[1]

    def window(self, pages: int) -> int:
        """How many slots one gather of ``pages`` pages holds: every slot when they fit ``workspace_bytes``, else as
        many as fit, never fewer than the most one layer keeps."""
        per_slot = pages * self.grid[0, 0].numel() * self.grid.element_size()
        return min(self.slots, max(self.layer_slots, self.workspace_bytes // max(per_slot, 1)))

    def workspace(self, numel: int) -> torch.Tensor:
        """The pool's reused buffer, at least ``numel`` elements (big fresh allocations cost page faults every step;
        grown with a quarter to spare, within ``workspace_bytes``); what it held before is garbage: a step's
        gathers fill it (``TokenIO.gather``)."""
        if not self._workspace or self._workspace[0].numel() < numel:
            room = self.workspace_bytes // self.grid.element_size()
            with torch.inference_mode(False):  # it outlives the step: a normal tensor, writable outside the runner
                self._workspace[:] = [self.grid.new_empty(max(numel, min(numel + numel // 4, room)))]
        return self._workspace[0][:numel]

    def reserve(self) -> int:
        """The workspace grown to its bound (``workspace_bytes``) at once and its pages faulted in (written), so no
        step pays for growing it; its bytes."""
        buffer = self.workspace(max(1, self.workspace_bytes // self.grid.element_size()))
        buffer.zero_()
        return buffer.numel() * buffer.element_size()

    def span(self, layer_id: int, names: tuple[str, ...]) -> slice:
        """The slots of ``layer_id``'s ``names`` (adjacent, in that order)."""
        key = (layer_id, names)
        found = self.spans.get(key)
        if found is None:
            try:
                first = self.slot[(layer_id, names[0])]
                adjacent = all(self.slot[(layer_id, n)] == first + i for i, n in enumerate(names))
            except KeyError:
                raise LayoutError(f"pool {self.pool_id}: layer {layer_id} keeps no {names} entries") from None
            if not adjacent:
                raise LayoutError(f"pool {self.pool_id}: layer {layer_id}'s {names} are not adjacent slots of a cell")
            found = self.spans[key] = slice(first, first + len(names))
        return found


@dataclass(frozen=True)
class StateEntry:
    offset: int  # bytes into the cell
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # per request


@dataclass(frozen=True)
class StateLayout:
    """One state pool: ``grid`` ``(cells, cell_words)``, the cells as the widest integers that tile them (whole-cell
    copies move words, not bytes: several times faster), ``entries[(layer, tensor)]`` where each tensor sits."""

    pool_id: PoolId
    grid: torch.Tensor
    entries: dict[tuple[int, str], StateEntry]
    joined: dict[tuple[int, tuple[str, ...]], StateEntry] = field(default_factory=dict)
    _workspace: list[torch.Tensor] = field(default_factory=list)  # at most one buffer: the step's gathered cells

    def workspace(self, rows: int) -> torch.Tensor:
        """A reused ``(rows, cell_words)`` buffer for the step's cells (a fresh one of megabytes each step would cost
        its page faults: widened Qwen3-Next, 32 decodes, 17 MB: ~10 -> ~3 ms a step); what it held is garbage."""
        if not self._workspace or self._workspace[0].shape[0] < rows:
            with torch.inference_mode(False):  # it outlives the step: a normal tensor
                self._workspace[:] = [self.grid.new_empty(rows + rows // 4, self.grid.shape[1])]
        return self._workspace[0][:rows]

    def entry(self, layer_id: int, names: tuple[str, ...]) -> StateEntry:
        """``names`` of ``layer_id`` as one entry: adjacent byte ranges, one dtype, joined along their first dim."""
        key = (layer_id, names)
        found = self.joined.get(key)
        if found is None:
            try:
                parts = [self.entries[(layer_id, n)] for n in names]
            except KeyError:
                raise LayoutError(f"pool {self.pool_id}: layer {layer_id} keeps no state {names}") from None
            first = parts[0]
            for a, b, name in zip(parts, parts[1:], names[1:], strict=False):
                if b.offset != a.offset + a.nbytes or b.dtype != a.dtype or b.shape[1:] != a.shape[1:]:
                    raise LayoutError(
                        f"pool {self.pool_id}: layer {layer_id}'s state {name} does not follow {names[0]}.. "
                        "in the cell with the same dtype and trailing dims; read them apart"
                    )
            shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
            found = StateEntry(first.offset, sum(p.nbytes for p in parts), first.dtype, shape)
            self.joined[key] = found
        return found


@dataclass(frozen=True)
class PoolLayouts:
    tokens: dict[PoolId, TokenLayout]
    states: dict[PoolId, StateLayout]
    pool_of: dict[int, PoolId]  # layer id -> the pool holding its entries


_LAYOUTS: weakref.WeakKeyDictionary[UnifiedMemory, PoolLayouts] = weakref.WeakKeyDictionary()


def pool_layouts(mem: UnifiedMemory) -> PoolLayouts:
    """The layouts of ``mem``'s pools (read once per memory; the grid never changes)."""
    found = _LAYOUTS.get(mem)
    if found is None:
        token_pools = [p for p in mem.pools.values() if p.layout.id_space is IdSpace.PAGE]
        workspace = int(mem.arena.nbytes * WORKSPACE_SHARE) // max(len(token_pools), 1)
        found = _LAYOUTS[mem] = PoolLayouts(
            {p.pool_id: _token_layout(p, workspace) for p in token_pools},
            {p.pool_id: _state_layout(p) for p in mem.pools.values() if p.layout.id_space is IdSpace.SLOT},
            {layer: p.pool_id for p in mem.pools.values() for layer in p.layout.layer_ids},
        )
    return found


def _token_layout(pool: SubPool, workspace_bytes: int) -> TokenLayout:
    segments = sorted(pool.layout.segments, key=lambda s: s.offset)
    first = segments[0]
    shape, dtype, entry = tuple(first.shape), first.dtype, first.nbytes
    odd = [
        f"layer {s.layer_id} {s.tensor} {tuple(s.shape)} {s.dtype}"
        for s in segments
        if (tuple(s.shape), s.dtype) != (shape, dtype)
    ]
    if odd:
        raise LayoutError(
            f"pool {pool.pool_id}: every layer must keep {shape} {dtype} entries per page like layer "
            f"{first.layer_id} {first.tensor}, but {', '.join(odd)} differ"
        )
    slot = {}
    for i, s in enumerate(segments):
        if s.offset != first.offset + i * entry:
            raise LayoutError(f"pool {pool.pool_id}: layer {s.layer_id} {s.tensor} is not slot {i} of the cell")
        slot[(s.layer_id, s.tensor)] = i
    page, inner = shape[0], shape[1:]
    grid_shape = (pool.grid_cells, len(segments), page, *inner)
    grid = pool.arena.strided_view(dtype, pool.grid_cells, pool.cell_bytes, first.offset, grid_shape[1:])
    layer_slots = max(Counter(s.layer_id for s in segments).values())
    return TokenLayout(pool.pool_id, grid, slot, workspace_bytes, layer_slots)


def _state_layout(pool: SubPool) -> StateLayout:
    grid = pool.arena.cell_grid(pool.grid_cells, pool.cell_bytes)
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if pool.cell_bytes % w.itemsize == 0)
    if grid.data_ptr() % word.itemsize == 0:
        grid = grid.view(word)
    entries = {}
    for s in pool.layout.segments:
        entries[(s.layer_id, s.tensor)] = StateEntry(s.offset, s.nbytes, s.dtype, tuple(s.shape))
    return StateLayout(pool.pool_id, grid, entries)


@dataclass(frozen=True)
class KeyPart:
    """Some rows of a padded group, with their keys in one token pool: the loaded slots' entries of their pages
    (every layer's, or a window of them; ``TokenIO.write`` says where a layer's are), as columns (a view into the
    step's one gathered buffer of the pool; a group's rows may be cut into parts of different widths, so short rows
    are not padded to the group's longest).

    Row ``r``'s column ``c`` holds position ``first_page[r] * page_size + c``: gathered entries where the
    position is older than the step; the step's new tokens once each layer wrote its entries there; zeros
    after the row's last token (its last page's tail, the padding page: stale or never written slots may
    hold any bytes, NaN included, and a masked key must still be finite).
    """

    entries: torch.Tensor  # (window slots, R_p, W, *shape)
    rows: slice  # the group's rows [a, b) it holds
    mask: torch.Tensor  # (R_p, 1, Q', W) additive float32: 0 where query q sees column c, -inf elsewhere
    spare: torch.Tensor | None  # (R_p, 1, 1, W) 1.0 at one zero column of each row that no query sees, else 0
    _sinks: dict[str, torch.Tensor] = field(default_factory=dict)

    def with_sinks(self, sinks: torch.Tensor) -> torch.Tensor:
        """``(R_p, heads, Q', W)``: the mask plus one more key per row and head, the spare zero column, whose logit
        is ``sinks[head]`` (gpt-oss's attention sinks: its zero value adds nothing but joins the softmax)."""
        if self.spare is None:
            raise ValueError("attention sinks need the step's spare key column: build the step with sinks=True")
        base = self._sinks.get("base")
        if base is None:
            base = self._sinks["base"] = torch.where(self.spare.bool(), 0.0, self.mask)
        return base + self.spare * cast(sinks.view(1, -1, 1, 1), base.dtype)


class TokenIO:
    """One token pool in one step: the parts' keys gathered into one buffer ``(window, columns, *shape)`` (every slot
    of the pool, or a window of them when they exceed the workspace), each layer's new entries written in with one
    indexed copy, stored in the pool with one indexed store (per layer when windowed)."""

    def __init__(
        self,
        layout: TokenLayout,
        buffer: torch.Tensor,
        parts: list[list[KeyPart]],
        new_cols: torch.Tensor,
        cell: torch.Tensor,
        offset: torch.Tensor,
        source: tuple[torch.Tensor, torch.Tensor],
        paged: PagedRows | None = None,
        spans: PagedRows | None = None,
    ):
        """``buffer``: ``gather`` of slots ``[0, window)``; ``parts[g]``: group ``g``'s rows in order (views of
        ``buffer``); ``new_cols`` ``(T,)``: the buffer column of each new token of the step (step order), ``cell`` /
        ``offset`` its pool cell and slot in the cell's page; ``source``: the pages' cells and zero columns
        ``gather`` took (a windowed step gathers again from them). ``paged``: the decode group read from the pages
        (``ops.paged_decode``): its tokens, the step's first, have no buffer columns (``new_cols`` and ``parts[0]``
        leave them out) and go to the pool as each layer writes them. ``spans``: likewise every row after it
        (``ops.paged_spans``): then nothing is gathered."""
        self.layout, self.buffer, self.parts = layout, buffer, parts
        self.new_cols, self.cell, self.offset = new_cols, cell, offset
        self.source, self.paged, self.spans = source, paged, spans
        self.loaded = slice(0, buffer.shape[0])  # the slots the buffer holds
        self.windowed = buffer.shape[0] < layout.slots
        self.written: set[int] = set()
        self.deferred = False  # some slots' new entries wait in the buffer for ``flush`` (not windowed, no kernel)

    @staticmethod
    def gather(
        layout: TokenLayout, cells: torch.Tensor, zero_cols: torch.Tensor, slots: slice, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Entries of ``slots`` of the pages ``cells`` (flat; the padding page is the sink, cell 0, zeroed here
        first): ``(len(slots), pages * page_size, *shape)``, also zero at columns ``zero_cols`` (the slots after each
        row's last token in its last page). ``out``: the buffer to fill (else the pool's workspace)."""
        grid = layout.grid
        grid[0].zero_()
        count, n = slots.stop - slots.start, cells.numel()
        if out is None:
            out = layout.workspace(count * n * grid[0, 0].numel())
        out = out.view(count, n, *grid.shape[2:])
        for i, s in enumerate(range(slots.start, slots.stop)):  # one contiguous copy per page and slot
            torch.index_select(grid[:, s], 0, cells, out=out[i])
        out = out.view(count, n * grid.shape[2], *grid.shape[3:])
        return out.index_fill_(1, zero_cols, 0)

    def write(self, span: slice, new: torch.Tensor | Sequence[torch.Tensor]) -> slice:
        """Put the step's new entries of ``span``'s slots, ``(T, len(span), *shape)`` or one ``(T, *shape)`` per slot,
        in every part's keys; returns where they are in the parts (read them as ``part.entries[returned]``). The pool
        gets them at ``flush``, or now when the step is windowed (the window is gathered first when ``span`` is
        outside it) or the kernel puts them (``ops.put_entries``); those of the rows read from their pages
        (``paged``, ``spans``) now, before the layer attends."""
        slots = tuple(new.unbind(1)) if isinstance(new, torch.Tensor) else tuple(new)
        direct = puts_entries(self.layout.grid, slots)
        for on_pages in (self.paged, self.spans):  # the rows read from their pages: their tokens lead the step's
            if on_pages is None:
                continue
            count = on_pages.cell.numel()
            if direct:
                put_pages(self.layout.grid, span, [x[:count] for x in slots], on_pages.cell, on_pages.offset)
            else:
                at = self.layout.grid[:, span].movedim(1, 2)  # (cells, page, len(span), *shape)
                at.index_put_((on_pages.cell, on_pages.offset), cast(torch.stack(slots, 1)[:count], at.dtype))
            slots = tuple(x[count:] for x in slots)
        if span.start < self.loaded.start or span.stop > self.loaded.stop:
            window = self.buffer.shape[0]
            start = min(span.start, self.layout.slots - window)
            self.loaded = slice(start, start + window)
            self.gather(self.layout, *self.source, self.loaded, out=self.buffer)
        local = slice(span.start - self.loaded.start, span.stop - self.loaded.start)
        if direct:
            if self.new_cols.numel():  # a step of paged decodes only has no buffer columns to fill
                put_columns(self.buffer, local, slots, self.new_cols)
                put_pages(self.layout.grid, span, slots, self.cell, self.offset)
        else:
            buffer = self.buffer[local]
            buffer.index_copy_(1, self.new_cols, cast(torch.stack(slots), buffer.dtype))
            if self.windowed:
                self._store(span, buffer)
            else:
                self.deferred = True
        self.written.update(range(span.start, span.stop))
        return local

    def flush(self) -> None:
        layout = self.layout
        if not self.written:
            return
        if len(self.written) != layout.slots:
            missing = sorted(set(range(layout.slots)) - self.written)
            raise LayoutError(f"pool {layout.pool_id}: the step wrote no new entries in slots {missing}")
        if self.deferred:
            self._store(slice(0, layout.slots), self.buffer)
        self.written.clear()
        self.deferred = False

    def _store(self, slots: slice, buffer: torch.Tensor) -> None:
        """The new entries of ``buffer`` (holding ``slots``) into the pool."""
        new = buffer.index_select(1, self.new_cols)  # (slots, T, *shape)
        self.layout.grid[:, slots].movedim(1, 2).index_put_((self.cell, self.offset), new.movedim(0, 1))


def _entry_bytes(cells: torch.Tensor, e: StateEntry) -> torch.Tensor:
    """``(cells, e.nbytes)`` uint8: entry ``e``'s bytes in each cell of ``cells`` (the pool's grid or rows of it)."""
    return cells.view(torch.uint8)[:, e.offset : e.offset + e.nbytes]


def _typed(entry_bytes: torch.Tensor, e: StateEntry) -> torch.Tensor:
    """``(cells, *e.shape)`` of ``e.dtype``: an entry's bytes per cell as its typed tensor."""
    return entry_bytes.view(e.dtype).view(entry_bytes.shape[0], *e.shape)


class StateIO:
    """The state pool in one step: every request's cell gathered once, updated in place, written back once (and
    into the reserved checkpoint cells of the requests that have one).

    With ``fast_paths(state_cells=...)`` on, no whole cell moves: the fresh rows' cells are zeroed in the pool, a
    layer that updates its state where it lies (``pool_view`` and ``cells``) reads and writes the pool during the
    step, each tensor read through ``view`` is gathered on first use (that tensor alone) and written back at
    ``flush``, and the checkpoint cells get whole-cell copies of their rows' cells after that."""

    def __init__(
        self,
        layout: StateLayout,
        cells: torch.Tensor,
        fresh: torch.Tensor | None,
        checkpoints: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """``fresh``: the rows whose state starts from zeros (all bytes 0), None when none does. ``checkpoints``:
        ``(rows, cells)``, cells that get a copy of those rows' states at ``flush``."""
        self.layout, self.cells, self.checkpoints = layout, cells, checkpoints
        self.rows: torch.Tensor | None = None  # the gathered whole cells (``state_cells`` off)
        self.gathered: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pool view, its rows) read through ``view``
        self.spare: torch.Tensor | None = None  # ``state_cells``: the pool's reused buffer as bytes, ``used`` of them
        self.used = 0
        if FAST.state_cells:
            if fresh is not None:
                layout.grid.index_fill_(0, cells.index_select(0, fresh), 0)
        else:
            if FAST.in_place_states:
                self.rows = torch.index_select(layout.grid, 0, cells, out=layout.workspace(cells.numel()))
            else:
                self.rows = layout.grid.index_select(0, cells)
            if fresh is not None:
                self.rows.index_fill_(0, fresh, 0)
        self.views: dict[tuple[int, tuple[str, ...]], torch.Tensor] = {}

    def pool_view(self, layer_id: int, names: tuple[str, ...]) -> torch.Tensor:
        """``(pool cells, *shape)`` typed view of ``names`` in every cell of the pool (row ``r`` of the step is cell
        ``cells[r]``); what a layer writes there is the pool's at once."""
        e = self.layout.entry(layer_id, names)
        return _typed(_entry_bytes(self.layout.grid, e), e)

    def _room(self, words: torch.Tensor) -> torch.Tensor:
        """Where the step's rows of ``words`` go: the next free bytes of the pool's reused buffer (fresh tensors of
        megabytes each step would cost their page faults: widened Nemotron-H, 64 rows, its SSM states: ~1.3x the
        whole-cell gather), or a new tensor where it is full or ``in_place_states`` is off."""
        rows, need = self.cells.numel(), self.cells.numel() * words.shape[1] * words.element_size()
        if FAST.in_place_states:
            if self.spare is None:
                self.spare = self.layout.workspace(rows + 1).view(-1).view(torch.uint8)
            start = -(-self.used // 8) * 8
            if start + need <= self.spare.numel():
                self.used = start + need
                return self.spare[start : start + need].view(words.dtype).view(rows, words.shape[1])
        return words.new_empty(rows, words.shape[1])

    def _words(self, e: StateEntry) -> torch.Tensor:
        """``(pool cells, words)``: ``e``'s bytes in every cell as the widest integers that tile them."""
        cells = _entry_bytes(self.layout.grid, e)
        word = next(w for w in (torch.int64, torch.int32, torch.int16) if (e.offset | e.nbytes) % w.itemsize == 0)
        aligned = cells.stride(0) % word.itemsize == 0 and cells.data_ptr() % word.itemsize == 0
        return cells.view(word) if aligned else cells

    def view(self, layer_id: int, names: tuple[str, ...]) -> torch.Tensor:
        """``(R, *shape)`` typed view of ``names`` (joined along their first dim) for every request of the step."""
        key = (layer_id, names)
        found = self.views.get(key)
        if found is None:
            e = self.layout.entry(layer_id, names)
            if self.rows is None:  # ``state_cells``: this tensor's rows alone, written back at ``flush``
                words = self._words(e)  # moved as the widest words that tile it (byte or bf16 copies: ~3x slower)
                rows = torch.index_select(words, 0, self.cells, out=self._room(words))
                self.gathered.append((words, rows))
                found = _typed(rows.view(torch.uint8), e)
            else:
                found = _typed(_entry_bytes(self.rows, e), e)
            self.views[key] = found
        return found

    def flush(self) -> None:
        grid = self.layout.grid
        if self.rows is not None:
            grid.index_copy_(0, self.cells, self.rows)
        for pool, rows in self.gathered:
            pool.index_copy_(0, self.cells, rows)
        self.gathered.clear()
        if self.checkpoints is not None:
            rows, cells = self.checkpoints
            if self.rows is not None:
                grid.index_copy_(0, cells, self.rows.index_select(0, rows))
            else:  # the rows' cells, complete in the pool now
                grid.index_copy_(0, cells, grid.index_select(0, self.cells.index_select(0, rows)))
