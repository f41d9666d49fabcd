"""Capacity planning: how many tokens and concurrent requests fit, unified vs static splits.

Pure arithmetic on a ``MemoryPlan`` (no arena is built): per pool, bytes per page / slot;
per request of ``context`` tokens, the cells each pool needs (full-history pools every
page, window pools their window plus one page, the state pool one slot). The unified pool
fits as many requests as the slab bytes allow; a static split fits the minimum over pools
of (pool bytes / per-request bytes of that pool). The static splits compared are the
published defaults of SGLang's hybrid pools: ``swa_full_tokens_ratio = 0.8`` (SWA pool
tokens = 0.8 x full pool tokens) and ``mamba_full_memory_ratio = 0.9`` (state bytes = 0.9 x
full KV bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.memory.layout import CellLayout
from hybridkv.memory.sizing import MemoryPlan

SGLANG_SWA_FULL_TOKENS_RATIO = 0.8
SGLANG_MAMBA_FULL_MEMORY_RATIO = 0.9


@dataclass(frozen=True)
class RequestFit:
    context: int
    bytes_per_request: int
    unified_requests: int
    static_requests: int
    static_split: dict[str, float]
    """Fraction of the budget each pool gets under the static split."""


def cells_per_request(layout: CellLayout, context: int) -> int:
    if layout.is_state:
        return 1
    pages = math.ceil(context / layout.page_size)
    if layout.is_window:
        assert layout.window is not None
        return min(pages, math.ceil(layout.window / layout.page_size) + 1)
    return pages


def usable_bytes(plan: MemoryPlan) -> int:
    return plan.num_slabs * plan.slab_bytes


def static_split(plan: MemoryPlan) -> dict[str, float]:
    """SGLang-default byte fractions per pool (history pools share the 'full' side)."""
    layouts = plan.layouts
    weight: dict[str, float] = {}
    history_bpt = sum(lay.bytes_per_token for lay in layouts if not lay.is_state and not lay.is_window)
    for lay in layouts:
        if lay.is_state:
            continue
        if lay.is_window:
            weight[lay.name] = SGLANG_SWA_FULL_TOKENS_RATIO * lay.bytes_per_token
        else:
            weight[lay.name] = lay.bytes_per_token
    if not weight and history_bpt == 0:
        return {lay.name: 1.0 for lay in layouts}
    kv_total = sum(weight.values())
    split = {name: w / kv_total for name, w in weight.items()}
    if any(lay.is_state for lay in layouts):
        state_share = SGLANG_MAMBA_FULL_MEMORY_RATIO / (1 + SGLANG_MAMBA_FULL_MEMORY_RATIO)
        split = {name: f * (1 - state_share) for name, f in split.items()}
        split.update({lay.name: state_share for lay in layouts if lay.is_state})
    return split


def fit_requests(plan: MemoryPlan, context: int) -> RequestFit:
    per_pool = {lay.name: cells_per_request(lay, context) * lay.cell_bytes for lay in plan.layouts}
    per_request = sum(per_pool.values())
    budget = usable_bytes(plan)
    unified = budget // per_request if per_request else 0
    split = static_split(plan)
    static = min(int(budget * split[name]) // need for name, need in per_pool.items() if need) if per_pool else 0
    return RequestFit(context, per_request, int(unified), int(static), split)


def max_tokens(plan: MemoryPlan) -> int:
    """Tokens of one sequence the unified pool holds (all pools for one long request)."""
    lo, hi = 0, plan.max_context * 64
    while lo < hi:
        mid = (lo + hi + 1) // 2
        need = sum(cells_per_request(lay, mid) * lay.cell_bytes for lay in plan.layouts)
        if need <= usable_bytes(plan):
            lo = mid
        else:
            hi = mid - 1
    return lo
