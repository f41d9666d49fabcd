"""What the parallel tests run inside each launched process (importable by name for spawn)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.forward.batch import ForwardBatch
from hybridkv.engine.parallel import StageGroups, launch
from hybridkv.engine.runner import ShardRunner, build_runner
from hybridkv.engine.sched.kv import Admission, Budget, RequestKV
from hybridkv.engine.sched.request import Request, SamplingParams
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import RECURRENT_POOL, IdSpace, KindTag, Parallel


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
    device: str = "cpu"
    """Where the rank's weights and memory live (``cuda``: the world is nccl, ``launch(device=...)``)."""


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


def serve_jobs(rank: int, jobs: list[Job]) -> tuple[int, list[RankResult]]:
    """Every process takes part in creating every job's groups; members serve the job. Returns (pid, results)."""
    from tests.engine.harness import live_counts, serve

    out = []
    for index, job in enumerate(jobs):
        groups = StageGroups.create(job.parallel, job.ranks, timeout_s=60)
        if groups is None:
            continue
        options = EngineConfig(
            gpu_memory=3_000_000, page_size=job.page_size, chunk_size=64, max_context=256, device=job.device
        )
        runner = build_runner(
            job.directory, job.directory, options, job.parallel, groups.pp_rank, groups.tp_rank, groups
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
                [torch.stack(s.logits).cpu().numpy() for s in served],
                shapes,
                before,
                live_counts(mem),
            )
        )
    return os.getpid(), out


def prefill(runner: ShardRunner, ids: list[int], chunk: int) -> tuple[RequestKV, Request]:
    """Prefill ``ids`` as one request in chunks of ``chunk``; the request stays allocated."""
    kv = RequestKV(runner.mem, prefix_cache=False)
    req = Request(0, list(ids), SamplingParams())
    assert kv.admit(req, Budget(chunk, alone=True)) is Admission.ADMITTED
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        prefix = req.computed
        kv.allocate([req], [len(piece)])
        runner.forward(ForwardBatch.build([piece], [prefix], [req.kv.token_locs()], [req.kv.state_slot], [req.fresh]))
        kv.computed([req])
        req.computed += len(piece)
    return kv, req


def slot_states(mem: UnifiedMemory, slot: int) -> dict[str, np.ndarray]:
    """Every state tensor of state slot ``slot``, keyed ``"layer/tensor"``."""
    cell = mem.page_cells([slot], RECURRENT_POOL)
    out = {}
    for layer in mem.shard.layers:
        if layer.tag is not KindTag.NONE and mem.pool_of_layer(layer.layer_id).layout.id_space is IdSpace.SLOT:
            for name in mem.geometry(layer.layer_id)["tensors"]:  # type: ignore[union-attr]
                out[f"{layer.layer_id}/{name}"] = mem.view(layer.layer_id, name)[cell][0].numpy().copy()
    return out


def tp2_prefill_states(rank: int, jobs: list[tuple[str, int, int, list[int]]]) -> dict[str, dict[str, np.ndarray]]:
    """Each TP 2 rank prefills each job's prompt (``(directory, page_size, chunk, ids)``) with its own
    engine; returns its slot's state tensors per model directory."""
    out = {}
    for directory, page_size, chunk, ids in jobs:
        groups = StageGroups.create(Parallel(tp_size=2), (0, 1), timeout_s=60)
        assert groups is not None
        options = EngineConfig(gpu_memory=3_000_000, page_size=page_size, max_context=256)
        runner = build_runner(directory, directory, options, groups.parallel, 0, groups.tp_rank, groups)
        kv, req = prefill(runner, ids, chunk)
        assert req.kv.state_slot is not None
        out[directory] = slot_states(runner.mem, req.kv.state_slot)
        kv.free(req, cache=False)
    return out


def wait_for_a_silent_peer(rank: int) -> None:
    """Rank 0 waits to receive from rank 1, which never sends: the collective timeout must end it."""
    if rank == 0:
        dist.recv(torch.empty(1), src=1)
    else:
        sleep_forever(rank)


def intra_op_threads(rank: int) -> int:
    return torch.get_num_threads()


def sleep_forever(rank: int) -> None:
    while True:
        time.sleep(1)


def write_pid_and_sleep(rank: int, directory: str) -> None:
    Path(directory, f"rank{rank}.pid").write_text(str(os.getpid()))
    sleep_forever(rank)


def launch_and_hang(directory: str) -> None:
    """Run as a script: launch a sleeping rank, then wait to be killed."""
    launch(write_pid_and_sleep, 1, (directory,), timeout_s=120)


if __name__ == "__main__":
    import sys

    launch_and_hang(sys.argv[1])
