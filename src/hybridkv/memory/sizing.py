"""Sizing: from (shard, byte budget, hints) to an arena plan, or a clear start-up error.

Invariants:
- The sink is exactly one largest cell; slabs are a whole multiple of the largest cell, so
  the pool with the largest cells (usually recurrent state) wastes nothing at slab edges.
- A plan exists only if one worst-case request fits (the feasibility floor): each pool holds
  what its history rule keeps of a ``max_context``-token request plus one prefill chunk in
  flight (``CellLayout.cells_per_request``): full-history pools every page, a
  sliding-window pool its window plus the chunk, the state pool one slot; each pool rounded
  up to whole slabs. An
  infeasible budget fails here, at start-up, naming the numbers and what to change,
  instead of livelocking once traffic arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.memory.errors import LayoutError
from hybridkv.memory.layout import CellLayout, build_layouts
from hybridkv.spec import PoolId, ShardSpec
from hybridkv.units import format_bytes


@dataclass(frozen=True)
class MemoryHints:
    page_size: int = 16
    max_context: int | None = None
    """Longest request to guarantee (default: the model's max context)."""
    chunk_tokens: int = 8192
    """Largest prefill chunk: SWA pages of a chunk are live before the window frees them."""
    slab_bytes: int | None = None
    target_slabs: int = 512


@dataclass(frozen=True)
class MemoryPlan:
    shard: ShardSpec
    budget_bytes: int
    page_size: int
    layouts: tuple[CellLayout, ...]
    sink_bytes: int
    slab_bytes: int
    max_context: int
    chunk_tokens: int

    @property
    def num_slabs(self) -> int:
        return (self.budget_bytes - self.sink_bytes) // self.slab_bytes

    def worst_case_cells(self) -> dict[PoolId, int]:
        """Cells each pool needs for one request at ``max_context`` tokens."""
        return {lay.pool_id: lay.cells_per_request(self.max_context, self.chunk_tokens) for lay in self.layouts}

    def min_cells_per_slab(self, layout: CellLayout) -> int:
        whole = self.slab_bytes // layout.cell_bytes
        aligned = self.slab_bytes % layout.cell_bytes == 0 and self.sink_bytes % layout.cell_bytes == 0
        return whole if aligned else whole - 1

    def worst_case_slabs(self) -> dict[PoolId, int]:
        cells = self.worst_case_cells()
        return {
            lay.pool_id: math.ceil(cells[lay.pool_id] / max(1, self.min_cells_per_slab(lay))) for lay in self.layouts
        }


def plan_memory(shard: ShardSpec, budget_bytes: int, hints: MemoryHints | None = None) -> MemoryPlan:
    hints = hints or MemoryHints()
    layouts = tuple(build_layouts(shard, hints.page_size))
    max_context = hints.max_context or shard.model.max_context
    if max_context <= 0:
        raise LayoutError(f"max_context must be positive, got {max_context}")
    largest = max((lay.cell_bytes for lay in layouts), default=4096)
    if hints.slab_bytes is not None:
        slab = hints.slab_bytes
        if slab < largest or slab % largest:
            raise LayoutError(
                f"slab_bytes {slab} must be a positive multiple of the largest cell "
                f"({largest} B, pool {max(layouts, key=lambda lay: lay.cell_bytes).pool_id})"
            )
    else:
        # about target_slabs slabs, but at least 8 of the largest cells each while that
        # still leaves 64 slabs, so the pool with huge cells (state) is not cut too fine
        target = max(budget_bytes // max(1, hints.target_slabs), min(8 * largest, budget_bytes // 64))
        slab = max(1, target // largest) * largest
    plan = MemoryPlan(
        shard=shard,
        budget_bytes=budget_bytes,
        page_size=hints.page_size,
        layouts=layouts,
        sink_bytes=largest,
        slab_bytes=slab,
        max_context=max_context,
        chunk_tokens=min(hints.chunk_tokens, max_context),
    )
    _check_feasible(plan)
    return plan


def _check_feasible(plan: MemoryPlan) -> None:
    need = plan.worst_case_slabs()
    total = sum(need.values())
    have = max(0, plan.num_slabs)
    if total <= have:
        return
    cells = plan.worst_case_cells()
    per_pool = ", ".join(f"{pool} {cells[pool]} cells = {n} slabs" for pool, n in need.items())
    need_bytes = plan.sink_bytes + total * plan.slab_bytes
    raise LayoutError(
        f"{plan.shard.describe()}: a budget of {format_bytes(plan.budget_bytes)} holds "
        f"{have} slabs of {format_bytes(plan.slab_bytes)}, but one request of "
        f"{plan.max_context} tokens needs {total} ({per_pool}). Raise the budget to at least "
        f"{format_bytes(need_bytes)}, lower max_context, or shard the model further (TP/PP)."
    )
