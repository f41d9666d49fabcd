"""A/B of the engine's prefill chunk and step budget, one process, alternating rounds (issue #35).

64 random prompts of 144 tokens submitted at once to an ``Engine`` per (chunk, step tokens) setting, 16 new
tokens each (greedy, EOS ignored), on a tiny random model widened x8 with a 32k vocabulary; wall time and the
median time to first token, median of 3 rounds after a warm-up round. ``hybridkv serve``'s default
(``cli/sizing.py``, ``SERVE_STEP_TOKENS``) was chosen with it.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python scripts/step_budget_ab.py tiny-gemma3 bf16
"""

from __future__ import annotations

import random
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import random_config
from hybridkv.engine.sched.request import SamplingParams

SETTINGS = {"c64/s1024": (64, 1024), "c512/s2048": (512, 2048), "c2048/s2048": (2048, 2048)}


def one_round(engine: Engine, seed: int, vocab: int) -> tuple[float, float]:
    """(wall seconds, median seconds to each request's first token) of one round."""
    rng = random.Random(seed)
    start = time.perf_counter()
    for _ in range(64):
        engine.submit([rng.randrange(3, vocab) for _ in range(144)], SamplingParams(max_new_tokens=16, ignore_eos=True))
    first: dict[object, float] = {}
    while engine.has_work():
        out = engine.step()
        for rid, _ in out.tokens:
            first.setdefault(rid, time.perf_counter() - start)
    ttft = sorted(first.values())
    return time.perf_counter() - start, ttft[len(ttft) // 2]


def main(name: str, dtype_name: str) -> None:
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    config = random_config(name, 8)
    config.vocab_size = 32000
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    engines = {}
    for label, (chunk, step) in SETTINGS.items():
        options = EngineConfig(gpu_memory="1GiB", chunk_size=chunk, max_step_tokens=step, dtype=dtype, max_context=512)
        engines[label] = Engine(config, model, options)
    for engine in engines.values():
        one_round(engine, 999, config.vocab_size)  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {label: [] for label in engines}
    for r in range(3):  # alternating: every setting once per round
        for label, engine in engines.items():
            runs[label].append(one_round(engine, r, config.vocab_size))
    for label, rows in runs.items():
        wall = sorted(w for w, _ in rows)[1]
        ttft = sorted(t for _, t in rows)[1]
        print(f"{name} {dtype_name} {label}: wall {wall * 1e3:.0f} ms, TTFT p50 {ttft * 1e3:.0f} ms")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny-gemma3", sys.argv[2] if len(sys.argv) > 2 else "bf16")
