"""What the parallel tests run inside each launched process (importable by name for spawn)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hybridkv.engine.parallel import ShardRunner, StageGroups
from hybridkv.spec import KindTag, Parallel


@dataclass(frozen=True)
class Job:
    """Serve ``prompts`` with model ``directory`` on layout ``parallel`` over world ``ranks``."""

    name: str
    directory: str
    parallel: Parallel
    ranks: tuple[int, ...]
    prompts: tuple[tuple[int, ...], ...]
    chunk: int
    max_new: int
    page_size: int


@dataclass(frozen=True)
class RankResult:
    job: int
    pp_rank: int
    tp_rank: int
    tokens: list[list[int]]
    logits: list[np.ndarray]  # per request: (max_new, vocab)
    view_shapes: dict[str, tuple[int, ...]]  # "layer/tensor" -> the memory view's shape past the cell dim
    live_before: tuple[int, int]
    live_after: tuple[int, int]


def serve_jobs(rank: int, jobs: list[Job]) -> list[RankResult]:
    """Every process takes part in creating every job's groups; members serve the job."""
    from tests.engine.harness import live_counts, serve

    out = []
    for index, job in enumerate(jobs):
        groups = StageGroups.create(job.parallel, job.ranks, timeout_s=60)
        if groups is None:
            continue
        runner = ShardRunner(
            job.directory,
            job.directory,
            job.parallel,
            groups.pp_rank,
            groups.tp_rank,
            groups,
            gpu_memory=3_000_000,
            page_size=job.page_size,
            chunk_size=64,
            max_context=256,
        )
        mem = runner.mem
        shapes = {}
        for layer in runner.shard.layers:
            if layer.tag is not KindTag.NONE:
                for tensor in mem.geometry(layer.layer_id)["tensors"]:  # type: ignore[union-attr]
                    shapes[f"{layer.layer_id}/{tensor}"] = tuple(mem.view(layer.layer_id, tensor).shape[1:])
        before = live_counts(mem)
        served = serve(runner, [list(p) for p in job.prompts], job.chunk, job.max_new)
        out.append(
            RankResult(
                index,
                groups.pp_rank,
                groups.tp_rank,
                [s.tokens for s in served],
                [torch.stack(s.logits).numpy() for s in served],
                shapes,
                before,
                live_counts(mem),
            )
        )
    return out


def record_pid(rank: int, directory: str) -> None:
    Path(directory, f"rank{rank}.pid").write_text(str(os.getpid()))


def fail_on_rank(rank: int, failing: int, directory: str) -> None:
    """``failing`` raises; every other rank waits for it in a receive that would never end."""
    record_pid(rank, directory)
    if rank == failing:
        raise RuntimeError(f"rank {rank} fails on purpose")
    buf = torch.empty(1)
    dist.recv(buf, src=failing)


def sleep_forever(rank: int, directory: str) -> None:
    record_pid(rank, directory)
    while True:
        time.sleep(1)
