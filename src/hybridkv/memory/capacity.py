"""Capacity planning: how many tokens and concurrent requests fit, unified vs static splits.

Pure arithmetic on a ``MemoryPlan`` (no arena is built): per pool, bytes per page / slot;
per request of ``context`` tokens, the cells each pool's history rule keeps
(``CellLayout.cells_per_request``: full-history pools every page, window pools their
window plus one page, the state pool one slot). The unified pool
fits as many requests as the slab bytes allow; a static split fits the minimum over pools
of (pool bytes / per-request bytes of that pool). The static splits compared are the
published defaults of SGLang's hybrid pools: ``swa_full_tokens_ratio = 0.8`` (SWA pool
tokens = 0.8 x full pool tokens) and ``mamba_full_memory_ratio = 0.9`` (state bytes = 0.9 x
full KV bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.memory.sizing import MemoryPlan
from hybridkv.spec import IdSpace, PoolId

SGLANG_SWA_FULL_TOKENS_RATIO = 0.8
SGLANG_MAMBA_FULL_MEMORY_RATIO = 0.9


@dataclass(frozen=True)
class RequestFit:
    context: int
    bytes_per_request: int
    unified_requests: int
    static_requests: int
    static_split: dict[PoolId, float]
    """Fraction of the budget each pool gets under the static split."""


def usable_bytes(plan: MemoryPlan) -> int:
    return plan.num_slabs * plan.slab_bytes


def static_split(plan: MemoryPlan) -> dict[PoolId, float]:
    """SGLang-default byte fractions per pool (history pools share the 'full' side; every
    pool with a bounded history gets the SWA ratio, every slot pool the state share)."""
    layouts = plan.layouts
    tokens = [lay for lay in layouts if lay.id_space is IdSpace.PAGE]
    slots = [lay for lay in layouts if lay.id_space is IdSpace.SLOT]
    weight = {
        lay.pool_id: (SGLANG_SWA_FULL_TOKENS_RATIO if lay.pool_id.releases_history else 1.0) * lay.bytes_per_token
        for lay in tokens
    }
    if not weight:
        return {lay.pool_id: 1.0 for lay in layouts}
    kv_total = sum(weight.values())
    split = {pool: w / kv_total for pool, w in weight.items()}
    if slots:
        state_share = SGLANG_MAMBA_FULL_MEMORY_RATIO / (1 + SGLANG_MAMBA_FULL_MEMORY_RATIO)
        split = {pool: f * (1 - state_share) for pool, f in split.items()}
        split.update({lay.pool_id: state_share for lay in slots})
    return split


def fit_requests(plan: MemoryPlan, context: int) -> RequestFit:
    per_pool = {lay.pool_id: lay.cells_per_request(context) * lay.cell_bytes for lay in plan.layouts}
    per_request = sum(per_pool.values())
    budget = usable_bytes(plan)
    unified = budget // per_request if per_request else 0
    split = static_split(plan)
    static = min(int(budget * split[pool]) // need for pool, need in per_pool.items() if need) if per_pool else 0
    return RequestFit(context, per_request, int(unified), int(static), split)


def max_tokens(plan: MemoryPlan) -> int:
    """Tokens of one sequence the unified pool holds (all pools for one long request)."""
    lo, hi = 0, plan.max_context * 64
    while lo < hi:
        mid = (lo + hi + 1) // 2
        need = sum(lay.cells_per_request(mid) * lay.cell_bytes for lay in plan.layouts)
        if need <= usable_bytes(plan):
            lo = mid
        else:
            hi = mid - 1
    return lo
