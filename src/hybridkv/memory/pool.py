"""SubPool: one layer kind's cells on its own uniform grid over the arena, and its tables.

Invariants (checked by ``UnifiedMemory.verify``):
- Grid cell ``c`` covers arena bytes ``[c * C, (c + 1) * C)``; it is *usable* only while every
  slab it touches is owned by this pool, and it is then FREE or LIVE, otherwise UNUSABLE.
- ``v2p[v] = c  <=>  p2v[c] = v`` for every live cell; ``v2p[0] = p2v[0] = 0`` (the sink);
  every other entry is the tombstone -1. The device tables mirror the host tables exactly;
  the host tables are authoritative, so no call here ever reads device memory.
- ``free_in_slab[j]`` counts FREE cells whose first byte is in slab ``j``; ``arena.slab_live``
  counts LIVE cells touching each slab. A slab whose live count drops to zero is handed
  back to the arena at once, so the split between pools follows the workload.
- Device writes use ``index_copy_`` / ``index_fill_`` with index tensors built from host
  arrays (never a scalar ``t[i] = x``, which is a blocking host->device copy).
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.memory.arena import FREE_SLAB, Arena
from hybridkv.memory.errors import LayoutError
from hybridkv.memory.layout import CellLayout

UNUSABLE, FREE, LIVE = 0, 1, 2


def to_index(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host int array -> int64 index tensor on ``device``, without a blocking copy."""
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class SubPool:
    def __init__(self, index: int, layout: CellLayout, arena: Arena, virtual_capacity: int):
        cell = layout.cell_bytes
        if cell > arena.slab_bytes:
            raise LayoutError(
                f"pool {layout.name!r}: one cell is {cell} B but a slab is {arena.slab_bytes} B; "
                "slabs must hold at least one whole cell (raise slab_bytes or lower page_size)"
            )
        if cell > arena.sink_bytes:
            raise LayoutError(f"pool {layout.name!r}: cell of {cell} B does not fit the {arena.sink_bytes} B sink")
        self.index = index
        self.layout = layout
        self.name = layout.name
        self.arena = arena
        self.cell_bytes = cell
        self.grid_cells = arena.nbytes // cell
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
        whole = (self.cell_lo == self.cell_hi) & (self.cell_lo >= 0) & (self.cell_lo < nslabs)
        self.whole_cells_in_slab = np.bincount(self.cell_lo[whole], minlength=nslabs)
        self.state = np.zeros(self.grid_cells, dtype=np.int8)
        self.free_in_slab = np.zeros(nslabs, dtype=np.int64)
        self.free_count = 0
        self.live_count = 0

        self.v2p = np.full(virtual_capacity, -1, dtype=np.int64)
        self.p2v = np.full(self.grid_cells, -1, dtype=np.int64)
        self.v2p[0] = 0
        self.p2v[0] = 0
        tdev = arena.table_device
        self.v2p_dev = torch.from_numpy(self.v2p.copy()).to(tdev)
        self.p2v_dev = torch.from_numpy(self.p2v.copy()).to(tdev)

    # --- slabs -----------------------------------------------------------------------------

    def _touching(self, slab: int) -> tuple[int, int]:
        """Grid cells ``[a, b)`` that touch ``slab`` (including a straddler from ``slab - 1``)."""
        a, b = int(self.slab_first[slab]), int(self.slab_first[slab + 1])
        if a > 0 and self.cell_hi[a - 1] == slab and self.cell_lo[a - 1] == slab - 1:
            a -= 1
        return a, b

    def _usable(self, cells: np.ndarray) -> np.ndarray:
        owner = self.arena.owner
        lo, hi = self.cell_lo[cells], self.cell_hi[cells]
        ok = (lo >= 0) & (hi < self.arena.num_slabs)
        lo_c, hi_c = (
            np.clip(lo, 0, self.arena.num_slabs - 1),
            np.clip(hi, 0, self.arena.num_slabs - 1),
        )
        return ok & (owner[lo_c] == self.index) & (owner[hi_c] == self.index)

    def acquire_slab(self, slab: int) -> int:
        """Take a free slab; its newly usable cells become FREE. Returns how many."""
        arena = self.arena
        assert arena.owner[slab] == FREE_SLAB
        arena.owner[slab] = self.index
        a, b = self._touching(slab)
        cells = np.arange(a, b)
        cells = cells[(self.state[cells] == UNUSABLE) & self._usable(cells)]
        self.state[cells] = FREE
        np.add.at(self.free_in_slab, self.cell_lo[cells], 1)
        self.free_count += cells.size
        return int(cells.size)

    def release_slab(self, slab: int) -> None:
        """Hand an owned slab with no live cells back to the arena."""
        arena = self.arena
        assert arena.owner[slab] == self.index and arena.slab_live[slab] == 0
        a, b = self._touching(slab)
        cells = np.arange(a, b)
        cells = cells[self.state[cells] == FREE]
        self.state[cells] = UNUSABLE
        np.subtract.at(self.free_in_slab, self.cell_lo[cells], 1)
        self.free_count -= cells.size
        arena.owner[slab] = FREE_SLAB

    def owned_slabs(self) -> np.ndarray:
        return np.flatnonzero(self.arena.owner == self.index)

    # --- cells -----------------------------------------------------------------------------

    def take_cells(self, count: int, avoid: frozenset[int] = frozenset()) -> np.ndarray:
        """Mark ``count`` FREE cells LIVE, fullest slabs first, none touching ``avoid`` slabs.

        The caller has checked that enough such cells exist.
        """
        out: list[np.ndarray] = []
        need = count
        slabs = np.flatnonzero(self.free_in_slab)
        order = slabs[np.argsort(self.free_in_slab[slabs], kind="stable")]
        for slab in order:
            if need == 0:
                break
            slab = int(slab)
            if slab in avoid:
                continue
            a, b = int(self.slab_first[slab]), int(self.slab_first[slab + 1])
            free = a + np.flatnonzero(self.state[a:b] == FREE)
            if avoid:
                free = free[~np.isin(self.cell_hi[free], list(avoid))]
            got = free[:need]
            out.append(got)
            need -= got.size
        if need:
            raise AssertionError(f"pool {self.name}: take_cells short by {need} (caller bug)")
        cells = np.concatenate(out) if out else np.empty(0, dtype=np.int64)
        self.state[cells] = LIVE
        np.subtract.at(self.free_in_slab, self.cell_lo[cells], 1)
        self._add_live(cells, 1)
        self.free_count -= cells.size
        self.live_count += cells.size
        return cells

    def give_cells(self, cells: np.ndarray) -> None:
        """Mark LIVE cells FREE; slabs left without live cells go back to the arena."""
        self.state[cells] = FREE
        np.add.at(self.free_in_slab, self.cell_lo[cells], 1)
        self._add_live(cells, -1)
        self.free_count += cells.size
        self.live_count -= cells.size
        touched = np.concatenate([self.cell_lo[cells], self.cell_hi[cells]])
        for slab in np.unique(touched[self.arena.slab_live[touched] == 0]):
            if self.arena.owner[slab] == self.index:
                self.release_slab(int(slab))

    def _add_live(self, cells: np.ndarray, delta: int) -> None:
        live = self.arena.slab_live
        np.add.at(live, self.cell_lo[cells], delta)
        lo, hi = self.cell_lo[cells], self.cell_hi[cells]
        straddle = hi != lo
        if straddle.any():
            np.add.at(live, hi[straddle], delta)

    # --- tables ----------------------------------------------------------------------------

    def bind(self, vids: np.ndarray, cells: np.ndarray) -> None:
        self.v2p[vids] = cells
        self.p2v[cells] = vids
        tdev = self.v2p_dev.device
        v_t, c_t = to_index(vids, tdev), to_index(cells, tdev)
        self.v2p_dev.index_copy_(0, v_t, c_t)
        self.p2v_dev.index_copy_(0, c_t, v_t)

    def unbind(self, vids: np.ndarray) -> np.ndarray:
        """Tombstone ``vids`` (all resident here) and return the cells they held."""
        cells = self.v2p[vids]
        self.v2p[vids] = -1
        self.p2v[cells] = -1
        tdev = self.v2p_dev.device
        self.v2p_dev.index_fill_(0, to_index(vids, tdev), -1)
        self.p2v_dev.index_fill_(0, to_index(cells, tdev), -1)
        return cells

    def resident(self, vids: np.ndarray) -> np.ndarray:
        return self.v2p[vids] >= 0

    # --- data ------------------------------------------------------------------------------

    def copy_cells(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole cells (every layer's bytes) ``src[i] -> dst[i]``; asynchronous on GPU."""
        if not self.arena.has_data or src.size == 0:
            return
        grid = self.arena.cell_grid(self.grid_cells, self.cell_bytes)
        dev = grid.device
        grid.index_copy_(0, to_index(dst, dev), grid.index_select(0, to_index(src, dev)))

    def live_cells_touching(self, slab: int) -> np.ndarray:
        a, b = self._touching(slab)
        return a + np.flatnonzero(self.state[a:b] == LIVE)

    def free_cells_touching(self, slab: int) -> int:
        a, b = self._touching(slab)
        return int(np.count_nonzero(self.state[a:b] == FREE))

    def move(self, src: np.ndarray, avoid: frozenset[int]) -> np.ndarray:
        """Move LIVE cells ``src`` to FREE cells outside ``avoid`` (bytes copied, tables rebound)."""
        dst = self.take_cells(src.size, avoid)
        vids = self.p2v[src]
        self.copy_cells(src, dst)
        self.p2v[src] = -1
        self.p2v_dev.index_fill_(0, to_index(src, self.p2v_dev.device), -1)
        self.bind(vids, dst)
        self.give_cells(src)
        return dst

    def view(self, layer_id: int, tensor: str) -> torch.Tensor:
        seg = self.layout.segment(layer_id, tensor)
        return self.arena.strided_view(seg.dtype, self.grid_cells, self.cell_bytes, seg.offset, seg.shape)
