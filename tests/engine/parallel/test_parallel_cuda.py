"""A TP/PP engine world over nccl on CUDA, token-exact against ``transformers`` (``scripts/gpu_check.sh``).

The disaggregated server's processes initialise gloo only (``engine/disagg/procs.py``), so the
nccl path is proved here: ``launch(device="cuda")`` joins an nccl world, every rank builds its
weights and memory on its GPU (rank ``r`` on GPU ``r % device_count``) and serves chunked
prefills and greedy decodes. nccl refuses two ranks of one communicator on one GPU, so the
world has as many ranks as there are GPUs, up to 2: TP 2 and PP 2 with two GPUs, a one-rank
world (still nccl, the layout's logits broadcast included) with one.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.parallel import launch
from hybridkv.spec import Parallel
from tests.engine.harness import hf_model, hf_reference, prompt
from tests.engine.parallel import worker
from tests.engine.parallel.worker import Job

PAGE, CHUNK, MAX_NEW = 4, 5, 5
LENGTHS = (3, 11, 26)
MODELS = ("tiny-qwen3-next", "tiny-gemma3", "tiny-kimi-linear")

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_an_nccl_world_on_cuda_serves_the_transformers_tokens(tmp_path_factory: pytest.TempPathFactory) -> None:
    world = min(2, torch.cuda.device_count())
    layouts = [Parallel(tp_size=2), Parallel(pp_size=2)] if world == 2 else [Parallel()]
    prompts = tuple(tuple(prompt(50 + n, n)) for n in LENGTHS)
    jobs = []
    for name in MODELS:
        directory = tmp_path_factory.mktemp(name)
        hf_model(name).save_pretrained(directory)
        for par in layouts:
            jobs.append(Job(name, str(directory), par, tuple(range(world)), prompts, CHUNK, MAX_NEW, PAGE, "cuda"))
    results = launch(worker.serve_jobs, world, (jobs,), device="cuda", timeout_s=300)
    served = [r for _, rank_results in results for r in rank_results]
    assert {r.job for r in served} == set(range(len(jobs)))
    for r in served:
        job = jobs[r.job]
        where = f"{job.name} {job.parallel} pp {r.pp_rank} tp {r.tp_rank}"
        assert r.live_after == r.live_before, f"{where}: pages/slots still live"
        for i, n in enumerate(LENGTHS):
            hf_tokens, _ = hf_reference(job.name, prompts[i], MAX_NEW)
            assert r.tokens[i][: len(hf_tokens)] == hf_tokens, f"{where}: prompt of {n} vs transformers"
