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
from typing import Any

from hybridkv.memory.layout import CellLayout
from hybridkv.memory.sizing import MemoryHints, MemoryPlan, parse_bytes, plan_memory
from hybridkv.spec import ModelSpec, Parallel, ShardSpec, get_preset

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


def plan_report(
    model: str | ModelSpec,
    gpu_memory: str,
    tp: int = 1,
    pp: int = 1,
    page_size: int = 16,
    contexts: list[int] | None = None,
) -> dict[str, Any]:
    """Per PP stage: each pool's geometry and, per context length, how many requests fit
    with the unified pool and with SGLang's default static split (one JSON-able dict).
    ``model`` is a preset name or a spec."""
    spec = model if isinstance(model, ModelSpec) else get_preset(model)
    parallel = Parallel(tp_size=tp, pp_size=pp)
    budget = parse_bytes(gpu_memory)
    contexts = contexts or sorted({4096, 32768, spec.max_context})
    stages = []
    for pp_rank in range(pp):
        shard = ShardSpec(spec, parallel, pp_rank, 0)
        plan = plan_memory(shard, budget, MemoryHints(page_size=page_size, max_context=min(contexts)))
        start, end = shard.bounds
        pools = [
            {
                "pool": lay.name,
                "layers": len(lay.layer_ids),
                "cell_bytes": lay.cell_bytes,
                "unit": "request" if lay.is_state else f"page of {lay.page_size} tokens",
                "bytes_per_token": None if lay.is_state else lay.bytes_per_token,
                "bytes_per_request": lay.cell_bytes if lay.is_state else None,
                "window": lay.window,
                "cells_per_request": {str(c): cells_per_request(lay, c) for c in contexts},
            }
            for lay in plan.layouts
        ]
        fits = [fit_requests(plan, c) for c in contexts]
        stages.append(
            {
                "pp_rank": pp_rank,
                "layers": [start, end],
                "slab_bytes": plan.slab_bytes,
                "slabs": plan.num_slabs,
                "pools": pools,
                "max_tokens_one_request": max_tokens(plan),
                "requests": [
                    {
                        "context": f.context,
                        "bytes_per_request": f.bytes_per_request,
                        "unified": f.unified_requests,
                        "static_sglang_default": f.static_requests,
                        "unified_over_static": (f.unified_requests / f.static_requests) if f.static_requests else None,
                        "static_split": f.static_split,
                    }
                    for f in fits
                ],
            }
        )
    return {
        "model": spec.name,
        "gpu_memory_bytes": budget,
        "tp": tp,
        "pp": pp,
        "page_size": page_size,
        "contexts": contexts,
        "stages": stages,
    }
