"""Replay real request traces through memory + prefix cache, tables only (no model compute),
optionally with host memory and a store below the device (``TierConfig``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridkv.replay.plot import plot_hit_vs_memory, plot_pool_split
from hybridkv.replay.report import build_report, compare
from hybridkv.replay.simulator import (
    EngineModel,
    ReplayConfig,
    ReplayError,
    ReplayResult,
    Simulator,
    simulate,
)
from hybridkv.replay.tiered import TierConfig
from hybridkv.replay.workload import ReplayRequest, Workload, load_workload
from hybridkv.traces import MOONCAKE_TRACE

DEMO_MODEL = "Qwen3-Next-80B-A3B-Instruct"
DEMO_MEMORY = "40GiB"
DEMO_REQUESTS = 300


def run_demo_replay(out_dir: Path) -> dict[str, Any]:
    """A short replay: the first 300 requests of the Mooncake conversation trace on a hybrid
    preset, LRU; writes ``replay_pool_split.png`` into ``out_dir`` and returns the report."""
    workload = load_workload(MOONCAKE_TRACE, limit=DEMO_REQUESTS)
    result = simulate(workload, ReplayConfig(model=DEMO_MODEL, gpu_memory=DEMO_MEMORY))
    report = build_report(result)
    report["plot"] = str(plot_pool_split([report], Path(out_dir) / "replay_pool_split.png"))
    return report


__all__ = [
    "EngineModel",
    "ReplayConfig",
    "ReplayError",
    "ReplayRequest",
    "ReplayResult",
    "Simulator",
    "TierConfig",
    "Workload",
    "build_report",
    "compare",
    "load_workload",
    "plot_hit_vs_memory",
    "plot_pool_split",
    "run_demo_replay",
    "simulate",
]
