"""Memory statistics: where every byte of the arena is, per pool, at one moment.

``live + free + edge waste`` of every pool, plus free slabs, sink and tail, add up to the
budget exactly (``verify()`` checks the same identity from first principles).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.memory.view import MemoryView
from hybridkv.spec import PoolId


@dataclass(frozen=True)
class PoolStats:
    pool_id: PoolId
    cell_bytes: int
    page_size: int
    slabs: int
    live_cells: int
    """Cells in use, the window-cached ones included."""
    free_cells: int
    cached_cells: int
    """Window-cached cells (live, kept by the prefix cache, reclaimed when memory is needed)."""
    live_bytes: int
    free_bytes: int
    edge_waste_bytes: int
    padding_bytes: int


@dataclass(frozen=True)
class MemoryStats:
    budget_bytes: int
    sink_bytes: int
    tail_bytes: int
    slab_bytes: int
    free_slabs: int
    total_slabs: int
    pools: tuple[PoolStats, ...]
    live_pages: int
    live_slots: int
    bytes_moved: int
    cells_moved: int

    @property
    def free_slab_bytes(self) -> int:
        return self.free_slabs * self.slab_bytes

    @property
    def waste_bytes(self) -> int:
        """Bytes that can hold no data now: slab edges, sink, tail (cell padding is separate)."""
        return sum(p.edge_waste_bytes for p in self.pools) + self.sink_bytes + self.tail_bytes

    def as_dict(self) -> dict[str, object]:
        return {
            "budget_bytes": self.budget_bytes,
            "sink_bytes": self.sink_bytes,
            "tail_bytes": self.tail_bytes,
            "slab_bytes": self.slab_bytes,
            "free_slabs": self.free_slabs,
            "total_slabs": self.total_slabs,
            "live_pages": self.live_pages,
            "live_slots": self.live_slots,
            "waste_bytes": self.waste_bytes,
            "bytes_moved": self.bytes_moved,
            "cells_moved": self.cells_moved,
            "pools": {str(p.pool_id): {k: v for k, v in p.__dict__.items() if k != "pool_id"} for p in self.pools},
        }


def collect_stats(mem: MemoryView) -> MemoryStats:
    pools = []
    for pool in mem.pools.values():
        slabs = pool.owned_slabs().size
        usable = pool.live_count + pool.free_count
        pools.append(
            PoolStats(
                pool_id=pool.pool_id,
                cell_bytes=pool.cell_bytes,
                page_size=pool.layout.page_size,
                slabs=slabs,
                live_cells=pool.live_count,
                free_cells=pool.free_count,
                cached_cells=mem.windows.held_count(pool.pool_id) if pool in mem.window_pools else 0,
                live_bytes=pool.live_count * pool.cell_bytes,
                free_bytes=pool.free_count * pool.cell_bytes,
                edge_waste_bytes=slabs * mem.arena.slab_bytes - usable * pool.cell_bytes,
                padding_bytes=usable * pool.layout.padding_bytes,
            )
        )
    return MemoryStats(
        budget_bytes=mem.arena.nbytes,
        sink_bytes=mem.arena.sink_bytes,
        tail_bytes=mem.arena.tail_bytes,
        slab_bytes=mem.arena.slab_bytes,
        free_slabs=mem.arena.free_slabs,
        total_slabs=mem.arena.num_slabs,
        pools=tuple(pools),
        live_pages=mem.pages.live_count,
        live_slots=mem.slots.live_count,
        bytes_moved=mem.broker.bytes_moved,
        cells_moved=mem.broker.cells_moved,
    )
