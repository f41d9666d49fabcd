"""Tensor- and pipeline-parallel serving in real processes (gloo on CPU), token-exact.

One launch of 4 processes serves every (model, layout) job one after another: Qwen3-Next
(GDN + full attention), Gemma 3 (sliding window 8), Kimi-Linear (MLA + KDA), Nemotron-H
(Mamba2 + attention + MLP) and gpt-oss (sinks, MoE biases) on TP 2, PP 2, PP 3 and PP 2 x TP 2,
plus TP 4 with GQA replication (2 KV heads on 4 ranks) and uneven custom stage starts. Each
job batches 3 requests (below, around and well above the window), prefills them in chunks
of 5 over pages of 4 and decodes 5 tokens greedily, every rank with its own memory and
allocator. Every rank reads only its part of the saved checkpoint.

Checked: greedy tokens equal the single-process engine's and ``transformers`` ``generate``'s
on every rank; last-position logits within ``ATOL_SINGLE`` of the single-process engine and
``ATOL_HF`` of ``transformers``. Measured on this machine: PP alone is bitwise equal to the
single process (max difference 0); TP (an all-reduce sums partial products in another
order) differs by at most ~5e-7 (Gemma 3: 4.8e-7, Nemotron-H 2.5e-7, gpt-oss 1.8e-7,
Qwen3-Next 1.5e-7, Kimi-Linear 1.3e-7) on logits of magnitude ~0.1-1; against
``transformers`` every layout is within 5.7e-7 (Gemma 3 TP 2; the single process alone:
4.3e-7). Each rank's memory passes ``verify()`` and holds nothing at the end; its views
have the shapes of its shard.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.parallel import LaunchError, LaunchTimeout, launch
from hybridkv.engine.runner import MemoryLayoutError, ShardRunner, build_runner
from hybridkv.engine.tensor_parallel import TensorParallel
from hybridkv.engine.weights import build_model, read_safetensors
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import ModelSpec, Parallel, ShardSpec
from tests.engine.harness import hf_model, hf_reference, make_runner, prompt, serve
from tests.engine.parallel import worker
from tests.engine.parallel.worker import Job

ATOL_SINGLE = 1e-5
ATOL_HF = 1e-4
PAGE, CHUNK, MAX_NEW = 4, 5, 5
LENGTHS = (3, 11, 26)
FULL = ("tiny-qwen3-next", "tiny-gemma3", "tiny-kimi-linear", "tiny-nemotron-h", "tiny-gpt-oss")
LAYOUTS = {
    "tp2": (Parallel(tp_size=2), (0, 1)),
    "pp2": (Parallel(pp_size=2), (2, 3)),
    "pp3": (Parallel(pp_size=3), (1, 2, 3)),
    "pp2xtp2": (Parallel(tp_size=2, pp_size=2), (0, 1, 2, 3)),
}
EXTRA = [
    ("tiny-gemma3", "tp4", Parallel(tp_size=4), (0, 1, 2, 3)),  # each KV head on 2 ranks
    ("tiny-gpt-oss", "tp4", Parallel(tp_size=4), (3, 2, 1, 0)),  # replication, and ranks in another order
    ("tiny-nemotron-h", "pp2@0,4", Parallel(pp_size=2, pp_starts=(0, 4)), (0, 1)),  # uneven custom stages
]


def _alive(pid: int) -> bool:
    """A running process (a zombie waiting for a reaper counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[worker.RankResult]]:
    """Every job's per-rank results, from one launch of 4 processes."""
    prompts = tuple(tuple(prompt(50 + n, n)) for n in LENGTHS)
    dirs = {}
    for name in FULL:
        dirs[name] = tmp_path_factory.mktemp(name)
        hf_model(name).save_pretrained(dirs[name])
    plan = [(name, key, *LAYOUTS[key]) for name in FULL for key in LAYOUTS] + EXTRA
    jobs = [Job(name, str(dirs[name]), par, ranks, prompts, CHUNK, MAX_NEW, PAGE) for name, _, par, ranks in plan]
    results = launch(worker.serve_jobs, 4, (jobs,), timeout_s=240)
    pids = [pid for pid, _ in results]
    assert not any(_alive(pid) for pid in pids), "the launcher left a child running"
    by_job: dict[tuple[str, str], list[worker.RankResult]] = {}
    for _, rank_results in results:
        for r in rank_results:
            name, key = plan[r.job][:2]
            by_job.setdefault((name, key), []).append(r)
    return by_job


def _spec(name: str) -> ModelSpec:
    """The spec the single-process harness serves ``name`` with."""
    return make_runner(name, PAGE).mem.shard.model


def _single(name: str) -> list:
    return serve(make_runner(name, PAGE), [prompt(50 + n, n) for n in LENGTHS], CHUNK, MAX_NEW)


@pytest.mark.parametrize("name", FULL)
def test_every_layout_serves_the_single_process_and_transformers_tokens(name: str, served: dict) -> None:
    single = _single(name)
    keys = [key for n, key in served if n == name]
    assert set(LAYOUTS) <= set(keys)
    for key in keys:
        ranks = served[(name, key)]
        par = (LAYOUTS[key] if key in LAYOUTS else next(e[2:] for e in EXTRA if e[:2] == (name, key)))[0]
        assert len(ranks) == par.pp_size * par.tp_size
        for r in ranks:
            where = f"{name} {key} pp {r.pp_rank} tp {r.tp_rank}"
            assert r.live_after == r.live_before, f"{where}: pages/slots still live"
            for i, n in enumerate(LENGTHS):
                ids = prompt(50 + n, n)
                assert r.tokens[i] == single[i].tokens, f"{where}: prompt of {n}"
                hf_tokens, hf_logits = hf_reference(name, tuple(ids), MAX_NEW)
                assert r.tokens[i][: len(hf_tokens)] == hf_tokens, f"{where}: prompt of {n} vs transformers"
                mine = torch.from_numpy(r.logits[i])
                assert float((mine - torch.stack(single[i].logits)).abs().max()) < ATOL_SINGLE, where
                rows = min(len(hf_logits), mine.shape[0])
                assert float((mine[:rows] - hf_logits[:rows]).abs().max()) < ATOL_HF, where


def test_pipeline_stages_are_bitwise_the_single_process(served: dict) -> None:
    """Without TP nothing is summed in another order: a stage split changes no bit of the logits."""
    for name in FULL:
        single = _single(name)
        for key in ("pp2", "pp3"):
            for r in served[(name, key)]:
                for i in range(len(LENGTHS)):
                    assert np.array_equal(r.logits[i], torch.stack(single[i].logits).numpy()), (name, key)


def test_each_rank_memory_holds_its_shard(served: dict) -> None:
    """Views per cell: K/V ``(page, kv heads, dim)``, MLA latent whole, state split by TP (q|k|v parts)."""

    def shapes(name: str, key: str, pp: int, tp: int) -> dict:
        return next(r.view_shapes for r in served[(name, key)] if (r.pp_rank, r.tp_rank) == (pp, tp))

    qwen = shapes("tiny-qwen3-next", "tp2", 0, 1)  # 2 KV heads, GDN 2 key / 4 value heads of 16
    assert qwen["1/k"] == (PAGE, 1, 16) and qwen["3/v"] == (PAGE, 1, 16)
    assert (qwen["0/conv_q"], qwen["0/conv_k"], qwen["0/conv_v"]) == ((16, 3), (16, 3), (32, 3))
    assert qwen["0/recurrent_state"] == (2, 16, 16)
    gemma = shapes("tiny-gemma3", "tp4", 0, 3)  # 2 KV heads replicated over 4 ranks
    assert gemma["0/k"] == (PAGE, 1, 16) and gemma["5/k"] == (PAGE, 1, 16)
    kimi = shapes("tiny-kimi-linear", "pp2xtp2", 1, 1)  # layers 2, 3: KDA, MLA
    convs = {"2/conv_q", "2/conv_k", "2/conv_v"}
    assert set(kimi) == {*convs, "2/recurrent_state", "3/latent"}
    assert kimi["3/latent"] == (PAGE, 1, 24) and {kimi[c] for c in convs} == {(32, 3)}
    nemo = shapes("tiny-nemotron-h", "pp3", 1, 0)  # layers 2, 3: Mamba2, attention
    assert set(nemo) == {"2/conv_x", "2/conv_B", "2/conv_C", "2/ssm_state", "3/k", "3/v"}
    assert (nemo["2/conv_x"], nemo["2/conv_B"], nemo["2/conv_C"]) == ((128, 3), (32, 3), (32, 3))
    assert nemo["2/ssm_state"] == (8, 16, 16)


def test_a_rank_reads_only_its_part_of_the_checkpoint(tmp_path: Path) -> None:
    """TP rank 1 of PP stage 1/2: no tensor of stage 0, and of a split weight exactly its rows."""
    name = "tiny-qwen3-next"
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    full = dict(hf.state_dict())
    tp = TensorParallel(2, 1, reduce=lambda x: x)
    model = build_model(hf.config, lambda m: read_safetensors(tmp_path, m), layers=(2, 4), tp=tp)
    read = read_safetensors(tmp_path, model)
    assert not any(".layers.0." in k or ".layers.1." in k or "embed_tokens" in k for k in read)
    conv = "model.layers.2.linear_attn.conv1d.weight"  # channels q(32) | k(32) | v(64): rank 1's of each
    want = torch.cat([full[conv][16:32], full[conv][48:64], full[conv][96:128]])
    assert torch.equal(read[conv], want) and torch.equal(model.layers["2"].linear_attn.conv1d.weight, want)
    o_proj = "model.layers.3.self_attn.o_proj.weight"
    assert torch.equal(read[o_proj], full[o_proj][:, 32:64])
    experts = full["model.layers.3.mlp.experts.gate_up_proj"]  # (E, gate 32 | up 32, H); saved per expert
    assert torch.equal(read["model.layers.3.mlp.experts.5.up_proj.weight"], experts[5, 48:64])
    assert torch.equal(model.layers["3"].mlp.gate_up_proj, torch.cat([experts[:, 16:32], experts[:, 48:64]], 1))
    down = full["model.layers.2.mlp.experts.down_proj"]
    assert torch.equal(read["model.layers.2.mlp.experts.7.down_proj.weight"], down[7, :, 16:32])


def test_a_one_process_built_runner_is_the_runner_of_the_whole_model() -> None:
    """``build_runner`` without a layout builds the whole model over the whole memory: the same tokens and logits
    as a runner over a model and a memory built apart (what ``Engine`` runs)."""
    name = "tiny-kimi-linear"
    hf = hf_model(name)
    runner = build_runner(
        hf.config, hf.state_dict(), EngineConfig(gpu_memory=4_000_000, page_size=PAGE, max_context=256)
    )
    prompts = [prompt(50 + n, n) for n in LENGTHS]
    got, single = serve(runner, prompts, CHUNK, MAX_NEW), _single(name)
    for a, b in zip(got, single, strict=True):
        assert a.tokens == b.tokens and torch.equal(torch.stack(a.logits), torch.stack(b.logits))


def test_a_memory_that_is_not_the_shard_of_the_model_is_refused() -> None:
    name = "tiny-qwen3-next"
    hf = hf_model(name)
    spec = _spec(name)
    model = build_model(hf.config, hf.state_dict(), tp=TensorParallel(2, 0, reduce=lambda x: x))
    whole = UnifiedMemory.create(ShardSpec.whole(spec), 2_000_000, page_size=PAGE, max_context=64)
    with pytest.raises(MemoryLayoutError, match=r"layer 0: memory holds .*conv_q.*\(32, 3\)"):
        ShardRunner(model, whole)


def test_a_collective_that_outlives_its_timeout_fails_and_the_silent_peer_is_stopped() -> None:
    """Rank 0 waits for rank 1, which sleeps: rank 0's receive times out, the launch fails naming it,
    and the sleeping rank is terminated: no child outlives the launch."""
    with pytest.raises(LaunchError, match=r"(?s)rank 0 ---.*recv") as caught:
        launch(worker.wait_for_a_silent_peer, 2, timeout_s=60, collective_timeout_s=3)
    assert not isinstance(caught.value, LaunchTimeout)
    assert len(caught.value.pids) == 2 and not any(_alive(pid) for pid in caught.value.pids)


def test_each_rank_runs_its_share_of_the_cpus_or_what_omp_num_threads_says(monkeypatch) -> None:
    """Two ranks on this host share its CPUs (torch's default would give each of them all the
    cores); an explicit OMP_NUM_THREADS wins (the forkserver's own environment says 1 under make)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch(worker.intra_op_threads, 2, timeout_s=60) == [3, 3]
    monkeypatch.delenv("OMP_NUM_THREADS")
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert launch(worker.intra_op_threads, 2, timeout_s=60) == [share, share]


def test_a_launch_that_runs_past_its_timeout_is_stopped() -> None:
    with pytest.raises(LaunchTimeout, match=r"ranks \[0, 1\] returned nothing within 3 s") as caught:
        launch(worker.sleep_forever, 2, timeout_s=3)
    assert len(caught.value.pids) == 2 and not any(_alive(pid) for pid in caught.value.pids)


def test_children_of_a_killed_launcher_exit_by_themselves(tmp_path: Path) -> None:
    """SIGKILL on the launching process (nothing can reap then): its rank notices and exits within seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    log = tmp_path / "launcher.log"  # its resource tracker reports the killed queue's semaphores here
    with log.open("w") as out:
        parent = subprocess.Popen(
            [sys.executable, "-m", "tests.engine.parallel.worker", str(tmp_path)], env=env, stderr=out
        )
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("rank*.pid")):
            assert time.monotonic() < deadline and parent.poll() is None, f"no rank started: {log.read_text()}"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)
