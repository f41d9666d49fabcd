"""SubPool: one layer kind's cells on its own uniform grid over the arena, and its tables.

Invariants (checked by ``UnifiedMemory.verify``):
- Grid cell ``c`` covers arena bytes ``[c * C, (c + 1) * C)``; it is *usable* only while every
  slab it touches is owned by this pool, and its ``CellStatus`` is then FREE or LIVE,
  otherwise UNUSABLE.
- The free stack holds exactly the FREE cells, each once; allocation pops from its top, so
  recently freed cells (and freshly acquired slabs) are reused first.
- ``v2p[v] = c  <=>  p2v[c] = v`` for every live cell; ``v2p[0] = p2v[0] = 0`` (the sink);
  every other entry is the tombstone -1. Host tables are authoritative; their device
  mirrors are brought up to date lazily (``MirroredTable``), so no call here reads the device.
- ``arena.slab_live`` counts LIVE cells touching each slab; a slab whose count drops to zero
  is handed back to the arena at once (except one spare per pool), so the split between
  pools follows the workload. The one exception is a move (``move``): it keeps every slab,
  because the broker's reclaim plan counted the free cells of the donor's other slabs; the
  broker settles the emptied ones when its call is done.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from hybridkv.memory.arena import FREE_SLAB, Arena
from hybridkv.memory.errors import LayoutError, OutOfMemory
from hybridkv.memory.layout import CellLayout
from hybridkv.memory.mirror import MirroredTable, to_index


class CellStatus(IntEnum):
    """What one grid cell of a pool is now (stored as int8 in ``SubPool.status``)."""

    UNUSABLE = 0  # some slab it touches is not this pool's
    FREE = 1
    LIVE = 2


# plain ints for the numpy tables: comparing an array with an IntEnum member is ~3x slower
UNUSABLE, FREE, LIVE = int(CellStatus.UNUSABLE), int(CellStatus.FREE), int(CellStatus.LIVE)


class SubPool:
    def __init__(self, index: int, layout: CellLayout, arena: Arena, virtual_capacity: int):
        cell = layout.cell_bytes
        if cell > arena.slab_bytes:
            raise LayoutError(
                f"pool {layout.pool_id}: one cell is {cell} B but a slab is {arena.slab_bytes} B; "
                "slabs must hold at least one whole cell (raise slab_bytes or lower page_size)"
            )
        if cell > arena.sink_bytes:
            raise LayoutError(f"pool {layout.pool_id}: cell of {cell} B does not fit the {arena.sink_bytes} B sink")
        self.index = index
        self.layout = layout
        self.pool_id = layout.pool_id
        self.arena = arena
        self.cell_bytes = cell
        self.grid_cells = arena.nbytes // cell
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        self._copy_grid: torch.Tensor | None = None
        slab, sink, nslabs = arena.slab_bytes, arena.sink_bytes, arena.num_slabs
        starts = np.arange(self.grid_cells, dtype=np.int64) * cell
        lo = (starts - sink) // slab
        hi = (starts + cell - 1 - sink) // slab
        head = starts < sink
        tail = ~head & (hi >= nslabs)
        self.cell_lo = np.where(head, -1, np.where(tail, nslabs, lo))
        self.cell_hi = np.where(head, -1, np.where(tail, nslabs, hi))
        # cells whose first byte lies in slab j are [slab_first[j], slab_first[j + 1])
        self.slab_first = np.searchsorted(self.cell_lo, np.arange(nslabs + 1), side="left")
        # second slab a cell touches, or the dummy bin ``nslabs`` when it lies in one slab
        self.cell_next = np.where(self.cell_hi != self.cell_lo, self.cell_hi, nslabs)
        self.status = np.zeros(self.grid_cells, dtype=np.int8)  # CellStatus per grid cell
        self._stack = np.empty(self.grid_cells, dtype=np.int64)
        self.free_count = 0
        self.live_count = 0
        self.last_slab = -1  # most recently acquired slab: the next one is sought beside it
        self.spare_slab = -1  # one emptied slab the pool keeps (see give_cells)
        self._v2p = MirroredTable(virtual_capacity, arena.table_device)
        self._p2v = MirroredTable(self.grid_cells, arena.table_device)
        self._v2p.set(np.zeros(1, dtype=np.int64), 0)
        self._p2v.set(np.zeros(1, dtype=np.int64), 0)
        self.v2p = self._v2p.host  # read-only views of the authoritative host tables
        self.p2v = self._p2v.host

    @property
    def v2p_dev(self) -> torch.Tensor:
        """Device copy of ``v2p`` (pending host updates applied first, asynchronously)."""
        return self._v2p.device

    @property
    def p2v_dev(self) -> torch.Tensor:
        return self._p2v.device

    def flush_tables(self) -> None:
        self._v2p.flush()

    # --- slabs -----------------------------------------------------------------------------

    def _touching(self, slab: int) -> tuple[int, int]:
        """Grid cells ``[a, b)`` that touch ``slab`` (including a straddler from ``slab - 1``)."""
        a, b = int(self.slab_first[slab]), int(self.slab_first[slab + 1])
        if a > 0 and self.cell_hi[a - 1] == slab and self.cell_lo[a - 1] == slab - 1:
            a -= 1
        return a, b

    def usable(self, cells: np.ndarray) -> np.ndarray:
        """Mask: cells whose every byte lies in slabs this pool owns."""
        owner, last = self.arena.owner, self.arena.num_slabs - 1
        lo, hi = self.cell_lo[cells], self.cell_hi[cells]
        inside = (lo >= 0) & (hi <= last)
        lo_c, hi_c = np.clip(lo, 0, last), np.clip(hi, 0, last)
        return inside & (owner[lo_c] == self.index) & (owner[hi_c] == self.index)

    def acquire_slab(self, slab: int) -> None:
        """Take a free slab; the cells it makes usable become FREE (on top of the stack).

        Cells wholly inside the slab always become usable; a cell straddling into a
        neighbour slab only when this pool owns that neighbour too.
        """
        owner = self.arena.owner
        assert owner[slab] == FREE_SLAB
        owner[slab] = self.index
        a, b = int(self.slab_first[slab]), int(self.slab_first[slab + 1])
        parts = []
        if b > a and self.cell_hi[b - 1] != slab:  # last cell straddles into slab + 1
            b -= 1
            if owner[slab + 1] == self.index and self.status[b] == UNUSABLE:
                parts.append(np.array([b]))
        parts.append(np.arange(a, b))
        straddler = a > 0 and self.cell_hi[a - 1] == slab and self.cell_lo[a - 1] == slab - 1
        if straddler and owner[slab - 1] == self.index and self.status[a - 1] == UNUSABLE:
            parts.append(np.array([a - 1]))
        cells = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self.status[cells] = FREE
        self._push(cells)
        self.last_slab = slab

    def release_slab(self, slab: int) -> None:
        """Hand an owned slab with no live cells back to the arena."""
        assert self.arena.owner[slab] == self.index and self.arena.slab_live[slab] == 0
        a, b = self._touching(slab)
        cells = np.arange(a, b)
        self.status[cells[self.status[cells] == FREE]] = UNUSABLE
        stack = self._stack[: self.free_count]
        kept = stack[self.status[stack] == FREE]
        self._stack[: kept.size] = kept
        self.free_count = kept.size
        self.arena.owner[slab] = FREE_SLAB

    def cells_gained(self, slab: int, planned: set[int]) -> int:
        """Cells ``acquire_slab(slab)`` would make usable once the ``planned`` slabs (acquired
        before it) are this pool's too: every cell touching it whose other slab, if any, the
        pool owns or plans to own (a cell larger than half a slab often straddles two). A cell
        touches at most two slabs, so only the first and the last cell touching ``slab`` can
        lie partly outside it: O(1)."""
        a, b = self._touching(slab)
        if a == b:
            return 0
        owner, nslabs = self.arena.owner, self.arena.num_slabs

        def ours(cell: int) -> bool:
            for s in (int(self.cell_lo[cell]), int(self.cell_hi[cell])):
                if not 0 <= s < nslabs or (s != slab and owner[s] != self.index and s not in planned):
                    return False
            return True

        return b - a - (not ours(a)) - (b - a > 1 and not ours(b - 1))

    def owned_slabs(self) -> np.ndarray:
        return np.flatnonzero(self.arena.owner == self.index)

    def live_cells_touching(self, slab: int) -> np.ndarray:
        a, b = self._touching(slab)
        return a + np.flatnonzero(self.status[a:b] == LIVE)

    def free_cells_touching(self, slab: int) -> int:
        a, b = self._touching(slab)
        return int(np.count_nonzero(self.status[a:b] == FREE))

    # --- cells -----------------------------------------------------------------------------

    def _push(self, cells: np.ndarray) -> None:
        self._stack[self.free_count : self.free_count + cells.size] = cells
        self.free_count += cells.size

    def free_cells(self) -> np.ndarray:
        return self._stack[: self.free_count].copy()

    def take_cells(self, count: int, avoid: frozenset[int] = frozenset()) -> np.ndarray:
        """Mark ``count`` FREE cells LIVE, none touching an ``avoid`` slab.

        The caller reserves them first (``SlabBroker.take`` / ``_reserve``); fewer free cells
        than asked is refused with ``OutOfMemory``, changing nothing.
        """
        top = self.free_count
        if not avoid:
            if count > top:
                self._refuse(count, top, avoid)
            cells = self._stack[top - count : top].copy()
            self.free_count = top - count
        else:
            stack = self._stack[:top]
            blocked = np.isin(self.cell_lo[stack], list(avoid)) | np.isin(self.cell_hi[stack], list(avoid))
            allowed = np.flatnonzero(~blocked)
            if allowed.size < count:
                self._refuse(count, allowed.size, avoid)
            chosen = np.zeros(top, dtype=bool)
            chosen[allowed[allowed.size - count :]] = True
            cells = stack[chosen]
            kept = stack[~chosen]
            self._stack[: kept.size] = kept
            self.free_count = kept.size
        self.status[cells] = LIVE
        self._add_live(cells, 1)
        self.live_count += cells.size
        return cells

    def _refuse(self, count: int, free: int, avoid: frozenset[int]) -> None:
        where = f" outside slabs {sorted(avoid)}" if avoid else ""
        raise OutOfMemory(
            f"pool {self.pool_id}: {count} cells asked but {free} free{where}; reserve cells through "
            "the slab broker (SlabBroker.take) before taking them, or raise the memory budget",
            {self.pool_id: count - free},
        )

    def give_cells(self, cells: np.ndarray) -> None:
        """Mark LIVE cells FREE; slabs left without live cells go back to the arena, but one
        (the spare) stays with the pool, so a pool that frees and allocates in turn does not
        hand the same slab back and forth. Other pools can still take the spare (it costs
        no move) and idle compaction releases it."""
        self.settle(self.vacate(cells))

    def vacate(self, cells: np.ndarray) -> np.ndarray:
        """Mark LIVE cells FREE and keep every slab; returns the slabs left without a live
        cell (``settle`` them once the caller no longer counts on their free cells)."""
        self.status[cells] = FREE
        self._push(cells)
        touched = self._add_live(cells, -1)
        self.live_count -= cells.size
        return touched[self.arena.slab_live[touched] == 0]

    def settle(self, slabs: np.ndarray) -> None:
        """Slabs left without live cells that this pool still owns: one becomes the spare, the
        rest go back to the arena (others are skipped)."""
        live, owner = self.arena.slab_live, self.arena.owner
        for slab in slabs:
            if owner[slab] != self.index or live[slab] > 0:
                continue
            spare = self.spare_slab
            if spare < 0 or owner[spare] != self.index or live[spare] > 0:
                self.spare_slab = int(slab)
            elif slab != spare:
                self.release_slab(int(slab))

    def _add_live(self, cells: np.ndarray, delta: int) -> np.ndarray:
        """Add ``delta`` to the live count of every slab the cells touch, once per touching cell (a cell may
        straddle into the next slab); returns those slabs, sorted, each once."""
        nslabs = self.arena.num_slabs
        if cells.size == 1:  # one cell (a state slot, a page): its one or two slabs, without a count of every slab
            cell = int(cells[0])
            both = (int(self.cell_lo[cell]), int(self.cell_next[cell]))
            slabs = np.array([s for s in both if 0 <= s < nslabs], dtype=np.int64)
            self.arena.slab_live[slabs] += delta
            return slabs
        touched = np.concatenate([self.cell_lo[cells], self.cell_next[cells]])
        counts = np.bincount(touched, minlength=nslabs + 1)[:nslabs]
        if delta > 0:
            self.arena.slab_live += counts
        else:
            self.arena.slab_live -= counts
        return np.flatnonzero(counts)

    # --- tables ----------------------------------------------------------------------------

    def bind(self, vids: np.ndarray, cells: np.ndarray) -> None:
        self._v2p.set(vids, cells)
        self._p2v.set(cells, vids)

    def unbind(self, vids: np.ndarray) -> np.ndarray:
        """Tombstone ``vids`` (all resident here) and return the cells they held."""
        cells = self.v2p[vids]
        self._v2p.set(vids, -1)
        self._p2v.set(cells, -1)
        return cells

    def resident(self, vids: np.ndarray) -> np.ndarray:
        return self.v2p[vids] >= 0

    # --- data ------------------------------------------------------------------------------

    def copy_cells(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole cells (every layer's bytes) ``src[i] -> dst[i]``; asynchronous on GPU."""
        if src.size == 0 or not self.arena.has_data:
            return
        grid = self._copy_grid
        if grid is None:  # built once, like the views
            grid = self.arena.cell_grid(self.grid_cells, self.cell_bytes)
            if self.cell_bytes % 8 == 0 and grid.data_ptr() % 8 == 0:
                grid = grid.view(torch.int64)  # whole-cell copies in words: several times faster than in bytes
            self._copy_grid = grid
        if src.size == 1:  # one cell (a fork, a checkpoint): a plain copy, no index tensors or temporary
            grid[int(dst[0])].copy_(grid[int(src[0])])
            return
        dev = grid.device
        grid.index_copy_(0, to_index(dst, dev), grid.index_select(0, to_index(src, dev)))

    def move(self, src: np.ndarray, avoid: frozenset[int]) -> np.ndarray:
        """Move LIVE cells ``src`` to FREE cells outside ``avoid`` (bytes copied, tables rebound).

        No slab changes owner here: returns the owned slabs the move left without a live
        cell (a cell straddling into a neighbour slab empties it too); the caller settles
        them (``settle``) once it no longer counts on their free cells.
        """
        dst = self.take_cells(src.size, avoid)
        vids = self.p2v[src]
        self.copy_cells(src, dst)
        self._p2v.set(src, -1)
        self.bind(vids, dst)
        return self.vacate(src)

    def view(self, layer_id: int, tensor: str) -> torch.Tensor:
        """The strided view of one segment over the whole grid; built once (the arena and the
        grid never change, compaction moves bytes between cells, not the views)."""
        key = (layer_id, tensor)
        view = self._views.get(key)
        if view is None:
            seg = self.layout.segment(layer_id, tensor)
            view = self.arena.strided_view(seg.dtype, self.grid_cells, self.cell_bytes, seg.offset, seg.shape)
            self._views[key] = view
        return view
