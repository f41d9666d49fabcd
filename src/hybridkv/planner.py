"""The planner: what fits on a device and what a PD transfer moves, as JSON-able reports.

Both ``hybridkv plan`` and ``hybridkv transfer-plan`` (and the demo) render these reports; nothing
here prints. Everything is computed on tables-only (``meta``) memories: no bytes are allocated.

Invariants: a report is a plain dict of numbers, strings and lists (``json.dumps`` works); its keys
are the CLI's ``--json`` contract; bad sizes or layouts raise ``ValueError``-family errors naming the
option to change.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridkv.memory import LayoutError, MemoryHints, UnifiedMemory, build_layouts, parse_bytes, plan_memory
from hybridkv.memory.capacity import fit_requests, max_tokens
from hybridkv.spec import IdSpace, ModelSpec, Parallel, ShardSpec, get_preset
from hybridkv.transfer import buffer_set_from_memory, memory_cells, pair_entries
from hybridkv.transfer.plan import Route, num_pages

_FAKE_BASE = 1 << 44  # meta memories have no addresses; each rank gets a made-up base
_RANK_SPAN = 1 << 40
MAX_PLAN_PAGES = 1 << 17
"""Pages of one request that ``transfer_plan_report`` inspects at most (2M tokens at 16 per page:
seconds and a few hundred MiB)."""


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
                "pool": str(lay.pool_id),
                "layers": len(lay.layer_ids),
                "cell_bytes": lay.cell_bytes,
                "unit": "request" if per_request else f"page of {lay.page_size} tokens",
                "bytes_per_token": None if per_request else lay.bytes_per_token,
                "bytes_per_request": lay.cell_bytes if per_request else None,
                "window": lay.pool_id.max_span if lay.pool_id.releases_history else None,
                "cells_per_request": {str(c): lay.cells_per_request(c) for c in contexts},
            }
            for lay in plan.layouts
            for per_request in [lay.id_space is IdSpace.SLOT]
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
                        "static_split": {str(pool): share for pool, share in f.static_split.items()},
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


def _meta_memory(shard: ShardSpec, page_size: int, seq_len: int) -> UnifiedMemory:
    """A tables-only memory with room for one request of ``seq_len`` tokens."""
    layouts = build_layouts(shard, page_size)
    slot = IdSpace.SLOT
    need = sum(lay.cell_bytes * (1 if lay.id_space is slot else num_pages(seq_len, page_size) + 2) for lay in layouts)
    hints = MemoryHints(page_size=page_size, max_context=seq_len, chunk_tokens=seq_len)
    budget = 4 * need
    while True:
        try:
            return UnifiedMemory(plan_memory(shard, budget, hints), "meta")
        except LayoutError:
            budget *= 2


def transfer_plan_report(
    model: str, prefill_pp: int, prefill_tp: int, decode_tp: int, seq_len: int, page_size: int
) -> dict[str, Any]:
    need = num_pages(seq_len, page_size)
    if need > MAX_PLAN_PAGES:
        raise ValueError(
            f"--seq-len {seq_len} in pages of {page_size} is {need} pages; transfer-plan inspects at most "
            f"{MAX_PLAN_PAGES} pages per request (raise --page-size or lower --seq-len)"
        )
    spec = get_preset(model)
    prefill = {
        (p, t): _meta_memory(ShardSpec(spec, Parallel(prefill_tp, prefill_pp), p, t), page_size, seq_len)
        for p in range(prefill_pp)
        for t in range(prefill_tp)
    }
    legs = []
    for d in range(decode_tp):
        dec = _meta_memory(ShardSpec(spec, Parallel(decode_tp, 1), 0, d), page_size, seq_len)
        dec_bufs = buffer_set_from_memory(dec, _FAKE_BASE)
        pages = dec.alloc_pages(need)
        slot = int(dec.alloc_state(1)[0]) if dec.slot_pools else None
        dst = memory_cells(dec, pages, slot)
        for k, ((p, t), mem) in enumerate(sorted(prefill.items())):
            bufs = buffer_set_from_memory(mem, _FAKE_BASE + (k + 1) * _RANK_SPAN)
            src_pages = mem.alloc_pages(pages.size)
            src_slot = int(mem.alloc_state(1)[0]) if mem.slot_pools else None
            pairs = pair_entries(bufs, dec_bufs)
            plan = Route(bufs, dec_bufs, pairs).plan(seq_len, memory_cells(mem, src_pages, src_slot), dst)
            mem.free_pages(src_pages)
            if src_slot is not None:
                mem.free_state(np.array([src_slot]))
            legs.append(
                {
                    "prefill": [p, t],
                    "decode_tp": d,
                    "layers": sorted({pair.layer_id for pair in pairs}),
                    "pairs": len(pairs),
                    "pieces": plan.pieces,
                    "ops": plan.num_ops,
                    "bytes": plan.nbytes,
                }
            )
    return {
        "model": spec.name,
        "prefill": {"pp": prefill_pp, "tp": prefill_tp},
        "decode": {"tp": decode_tp},
        "seq_len": seq_len,
        "page_size": page_size,
        "legs": legs,
    }
