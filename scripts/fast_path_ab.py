"""A/B of engine fast-path switches, one process, alternating rounds (issue #35).

Side A runs with the named ``fast_paths`` switches off, side B with them on, on one ``Engine`` (a tiny random model
widened x8, vocabulary 32k): the random workload (64 prompts of 144 random tokens submitted at once, 16 new tokens
each, greedy, EOS ignored; wall time) and one such request alone (best of 3 per round), after a warm-up of each side;
rounds alternate which side goes first. Prints each side's median and the median of the per-round B/A ratios.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python scripts/fast_path_ab.py tiny-qwen3-next bf16 state_cells 7
"""

from __future__ import annotations

import random
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.random_models import random_config
from hybridkv.engine.sched.request import SamplingParams


def main(name: str, dtype_name: str, switches: list[str], rounds: int) -> None:
    torch.set_num_threads(1)
    cfg = random_config(name, 8)
    cfg.vocab_size = 32000
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    config = EngineConfig(gpu_memory="1GiB", chunk_size=2048, max_step_tokens=2048, dtype=dtype, max_context=512)
    engine = Engine(cfg, hf, config)

    def run(on: bool, seed: int, requests: int) -> float:
        rng = random.Random(seed)
        with fast_paths(**dict.fromkeys(switches, on)):
            for _ in range(requests):
                ids = [rng.randrange(3, cfg.vocab_size) for _ in range(144)]
                engine.submit(ids, SamplingParams(max_new_tokens=16, ignore_eos=True))
            start = time.perf_counter()
            while engine.has_work():
                engine.step()
            return time.perf_counter() - start

    for on in (False, True):
        run(on, 1, 64)
        run(on, 1, 1)
    many: dict[bool, list[float]] = {False: [], True: []}
    alone: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            many[on].append(run(on, 2 + r, 64))
            alone[on].append(min(run(on, 100 + 3 * r + k, 1) for k in range(3)))

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    for label, times in (("random 64 x 144 + 16", many), ("alone 144 + 16", alone)):
        a, b = median(times[False]), median(times[True])
        paired = median([y / x for x, y in zip(times[False], times[True], strict=True)])
        print(f"{name} {dtype_name} {label}: A (off) {a * 1e3:.0f} ms, B (on) {b * 1e3:.0f} ms, B/A {paired:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]) if len(sys.argv) > 4 else 5)
