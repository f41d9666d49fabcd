"""The demo: the planner on real models, then a simulated serving run on the real Mooncake
conversation trace whose byte split between pools is plotted over time (PNG).

Everything runs on a ``meta`` arena (tables only), so real-size models fit on a laptop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hybridkv.cli.plan_cmd import plan_report
from hybridkv.memory import MemoryHints, OutOfMemory, UnifiedMemory, plan_memory
from hybridkv.spec import ShardSpec, get_preset
from hybridkv.traces import load_mooncake_trace

PLAN_MODELS = ["Qwen3-Next-80B-A3B-Instruct", "Gemma-3-27B-IT", "gpt-oss-120b", "Kimi-Linear-48B-A3B-Instruct"]


def plan_summary(gpu_memory: str = "80GiB") -> list[dict[str, Any]]:
    rows = []
    for model in PLAN_MODELS:
        report = plan_report(model, gpu_memory, tp=1, pp=1, contexts=[8192, 32768])
        for fit in report["stages"][0]["requests"]:
            rows.append(
                {
                    "model": model,
                    "context": fit["context"],
                    "unified": fit["unified"],
                    "static": fit["static_sglang_default"],
                    "ratio": fit["unified_over_static"],
                }
            )
    return rows


def split_timeline(model: str, budget: int, requests: int, page_size: int = 16) -> dict[str, Any]:
    """Serve the first ``requests`` of the Mooncake conversation trace (no prefix cache):
    admit in arrival order while memory allows, prefill, decode one token a step for every
    running request, free at the end; sample every pool's bytes after each step."""
    shard = ShardSpec.whole(get_preset(model))
    plan = plan_memory(shard, budget, MemoryHints(page_size=page_size, max_context=131072, chunk_tokens=16384))
    mem = UnifiedMemory(plan, device="meta")
    windows = [lay.window for lay in plan.layouts if lay.is_window]
    queue = list(load_mooncake_trace(limit=requests))[::-1]
    running: list[dict[str, Any]] = []
    samples: dict[str, list[int]] = {pool: [] for pool in mem.pools}
    running_count: list[int] = []
    preempted = 0

    def release(r: dict[str, Any]) -> None:
        mem.free_segment(r["row"], 0)
        if r["slot"] is not None:
            mem.free_state(r["slot"])

    while queue or running:
        while queue and len(running) < 128:  # admit in arrival order while memory allows
            req = queue[-1]
            try:
                row = mem.alloc(req.input_length)
            except OutOfMemory:
                break
            try:
                slot = mem.alloc_state(1) if mem.state_pool is not None else None
            except OutOfMemory:
                mem.free_segment(row, 0)
                break
            queue.pop()
            running.append({"req": req, "row": row, "left": req.output_length, "slot": slot, "dropped": 0})
            _drop_window(mem, running[-1], windows)
        while running:  # one decode step; on a full arena, preempt the newest request
            try:
                out = mem.alloc_decode(
                    np.array([r["row"].size + 1 for r in running]), np.array([r["row"][-1] for r in running])
                )
                break
            except OutOfMemory:
                victim = running.pop()
                release(victim)
                queue.append(victim["req"])
                preempted += 1
        else:
            continue
        for r, loc in zip(running, out, strict=True):
            r["row"] = np.append(r["row"], loc)
            r["left"] -= 1
            _drop_window(mem, r, windows)
            if r["left"] <= 0:
                release(r)
        running = [r for r in running if r["left"] > 0]
        for name, pool in mem.pools.items():
            samples[name].append(int(pool.owned_slabs().size) * mem.arena.slab_bytes)
        running_count.append(len(running))
    mem.verify()
    return {"model": model, "budget": budget, "samples": samples, "running": running_count, "preempted": preempted}


def _drop_window(mem: UnifiedMemory, req: dict[str, Any], windows: list[int]) -> None:
    """Free the request's pages that left every sliding window (one call for all pools)."""
    if not windows:
        return
    ps = mem.page_size
    first_needed = max(0, req["row"].size - max(windows)) // ps
    if first_needed > req["dropped"]:
        mem.free_window_pages(req["row"][req["dropped"] * ps : first_needed * ps : ps] // ps)
        req["dropped"] = first_needed


def plot_timeline(timeline: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(timeline["samples"])
    data = np.array([timeline["samples"][n] for n in names], dtype=float) / 2**30
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.stackplot(np.arange(data.shape[1]), data, labels=names)
    ax.axhline(timeline["budget"] / 2**30, color="black", lw=0.8, ls="--", label="budget")
    ax.set_xlabel("decode step")
    twin = ax.twinx()
    twin.plot(timeline["running"], color="black", lw=0.7, label="running requests")
    twin.set_ylabel("running requests")
    ax.set_ylabel("GiB held (whole slabs)")
    ax.set_title(f"{timeline['model']}: byte split between pools follows the traffic (no fixed split)")
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
