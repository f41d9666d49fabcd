"""The planner command and the memory benchmark's replay protocol."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from hybridkv.bench.memory import BaselineAllocator, UnifiedAllocator, replay
from hybridkv.bench.static_pools import StaticAllocator
from hybridkv.cli import app
from hybridkv.memory import MemoryHints, UnifiedMemory, plan_memory
from hybridkv.spec import FULL_POOL, ShardSpec, WindowPool, get_preset
from hybridkv.traces import load_peer_trace


def test_plan_json_is_one_object_with_unified_never_below_static():
    result = CliRunner().invoke(
        app,
        ["plan", "--model", "Qwen3-Next-80B-A3B-Instruct", "--gpu-memory", "80GiB", "--tp", "2", "--pp", "2", "--json"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [s["layers"] for s in report["stages"]] == [[0, 24], [24, 48]]
    pools = {p["pool"]: p for p in report["stages"][0]["pools"]}
    assert pools["full"]["bytes_per_token"] == 6 * 2 * 1 * 256 * 2  # 6 layers, K+V, 1 head at TP 2
    assert pools["state"]["bytes_per_request"] == 18 * (8192 * 3 * 2 // 2 + 16 * 128 * 128 * 4)
    for row in report["stages"][0]["requests"]:
        assert row["unified"] >= row["static_sglang_default"] > 0


def test_unified_and_static_allocators_agree_on_the_trace_protocol():
    """Both allocators replay the same calls; after every call their live pages agree
    (except inside hybridkv's free groups, which release at the group's exit)."""
    trace = load_peer_trace()
    trace = {"alloc": {**trace["alloc"], "events": trace["alloc"]["events"][:600]}}
    shard = ShardSpec.whole(get_preset("Gemma-3-27B-IT"))
    mem = UnifiedMemory(plan_memory(shard, 2**38, MemoryHints(page_size=16, max_context=8192)), device="meta")
    baseline = StaticAllocator(40_000, 16, swa_pages=40_000)
    ours: list[tuple[int, int]] = []
    in_group: list[bool] = []
    theirs: list[tuple[int, int]] = []
    replay(
        trace,
        UnifiedAllocator(mem),
        16,
        WindowPool(1024),
        False,
        lambda: (
            ours.append((mem.pools[FULL_POOL].live_count, mem.pools[WindowPool(1024)].live_count))
            or in_group.append(mem._group is not None)
            or {}
        ),
    )
    assert baseline.swa is not None
    replay(
        trace,
        BaselineAllocator(baseline, None),
        16,
        WindowPool(1024),
        False,
        lambda: (
            theirs.append((40_000 - baseline.full.free_pages.numel(), 40_000 - baseline.swa.free_pages.numel())) or {}
        ),
    )
    assert len(ours) == len(theirs) > 1000
    settled = ~np.array(in_group)
    assert settled.sum() > 1000
    assert np.array_equal(np.array(ours)[settled], np.array(theirs)[settled])
    assert max(swa for _, swa in ours) < max(full for full, _ in ours)  # the window really frees pages
    mem.verify()
