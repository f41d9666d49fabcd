"""A/B of engine fast-path switches over ``Engine``, one process, alternating rounds (issue #35).

Two workloads on a tiny random model widened x8 with a 32k vocabulary, bf16, one torch thread: 64 random prompts
of 144 tokens submitted at once (16 new tokens each, greedy, EOS ignored; steps of 2048 tokens), and one such
request alone (the best of 3). Each run draws fresh prompts (no prefix-cache hits across runs). The switches named
(comma-separated ``fast_paths`` fields) are all off, then all on, swapping the order every round; the figure is the
process CPU time of the runs (on a shared machine, descheduled time would swamp the difference), median of the rounds.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python scripts/fast_path_ab.py tiny-gemma3 put_entries,band_attention 8
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.random_models import random_config
from hybridkv.engine.sched.request import SamplingParams


def main(name: str, switches: list[str], rounds: int) -> None:
    torch.set_num_threads(1)
    cfg = random_config(name, 8)
    cfg.vocab_size = 32000
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    config = EngineConfig(
        gpu_memory="1GiB", chunk_size=2048, max_step_tokens=2048, dtype=torch.bfloat16, max_context=512
    )
    engine = Engine(cfg, hf, config)
    seeds = iter(range(1000, 10**6))

    def run(n: int) -> float:
        rng = random.Random(next(seeds))
        for _ in range(n):
            prompt = [rng.randrange(3, cfg.vocab_size) for _ in range(144)]
            engine.submit(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))
        start = time.process_time()
        while engine.has_work():
            engine.step()
        return time.process_time() - start

    times: dict[tuple[str, bool], list[float]] = {(w, on): [] for w in ("random", "alone") for on in (False, True)}
    for on in (False, True):  # warm-up
        with fast_paths(**dict.fromkeys(switches, on)):
            run(64)
            run(1)
    for r in range(rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            with fast_paths(**dict.fromkeys(switches, on)):
                times[("random", on)].append(run(64))
                times[("alone", on)].append(min(run(1) for _ in range(3)))
    for w in ("random", "alone"):
        off, on = statistics.median(times[(w, False)]), statistics.median(times[(w, True)])
        print(f"{name} {w}: {','.join(switches)} off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms, on/off {on / off:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]) if len(sys.argv) > 3 else 8)
