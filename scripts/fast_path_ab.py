"""A/B of engine fast-path switches over ``Engine``, one process, alternating rounds (issue #35).

Three workloads on a tiny random model widened x8 with a 32k vocabulary, ``--dtype`` bf16 (default) or fp32, one
torch thread, 16 new tokens each (greedy, EOS ignored; steps of 2048 tokens):

- ``random``: 64 random prompts of 144 tokens submitted at once;
- ``shared``: a random 128-token prefix run alone first (not timed: it fills the prefix cache), then 64 prompts of
  that prefix and 16 tokens of their own submitted at once (the run checks that each hit the cached prefix);
- ``alone``: one random 144-token prompt alone (the best of 3).

Each run draws fresh prompts (no prefix-cache hits across runs). The switches named (comma-separated ``fast_paths``
fields) are all off, then all on, swapping the order every round; the figure is the process CPU time of the runs (on
a shared machine, descheduled time would swamp the difference), median of the rounds, then each round's on/off.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python scripts/fast_path_ab.py tiny-gemma3 put_entries,band_attention 8
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python scripts/fast_path_ab.py tiny-gemma3 packed_fp32 6 --dtype float32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.random_models import random_config
from hybridkv.engine.sched.request import SamplingParams

WORKLOADS = ("random", "shared", "alone")
NEW = SamplingParams(max_new_tokens=16, ignore_eos=True)


def main(name: str, switches: list[str], rounds: int, dtype: torch.dtype) -> None:
    torch.set_num_threads(1)
    cfg = random_config(name, 8)
    cfg.vocab_size = 32000
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    config = EngineConfig(gpu_memory="1GiB", chunk_size=2048, max_step_tokens=2048, dtype=dtype, max_context=512)
    engine = Engine(cfg, hf, config)
    seeds = iter(range(1000, 10**6))

    def tokens(rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(3, cfg.vocab_size) for _ in range(n)]

    def drain() -> float:
        start = time.process_time()
        while engine.has_work():
            engine.step()
        return time.process_time() - start

    def run(workload: str) -> float:
        rng = random.Random(next(seeds))
        if workload == "alone":
            engine.submit(tokens(rng, 144), NEW)
            return drain()
        if workload == "random":
            for _ in range(64):
                engine.submit(tokens(rng, 144), NEW)
            return drain()
        prefix = tokens(rng, 128)
        engine.submit(prefix, SamplingParams(max_new_tokens=1, ignore_eos=True))
        drain()
        cached = engine.stats["cached_tokens"]
        for _ in range(64):
            engine.submit(prefix + tokens(rng, 16), NEW)
        took = drain()
        if engine.stats["cached_tokens"] - cached < 64 * 64:
            raise RuntimeError(f"shared: {engine.stats['cached_tokens'] - cached} cached tokens, want ~64 x 128")
        return took

    def timed(workload: str) -> float:
        return min(run(workload) for _ in range(3)) if workload == "alone" else run(workload)

    times: dict[tuple[str, bool], list[float]] = {(w, on): [] for w in WORKLOADS for on in (False, True)}
    for on in (False, True):  # warm-up
        with fast_paths(**dict.fromkeys(switches, on)):
            for w in WORKLOADS:
                run(w)
    for r in range(rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            with fast_paths(**dict.fromkeys(switches, on)):
                for w in WORKLOADS:
                    times[(w, on)].append(timed(w))
    label = str(dtype).removeprefix("torch.")
    for w in WORKLOADS:
        off, on = statistics.median(times[(w, False)]), statistics.median(times[(w, True)])
        rounds_ratio = " ".join(f"{b / a:.2f}" for a, b in zip(times[(w, False)], times[(w, True)], strict=True))
        print(
            f"{name} {label} {w}: {','.join(switches)} off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms, "
            f"on/off {on / off:.3f} (rounds: {rounds_ratio})"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a random model's name (hybridkv.engine.random_models), e.g. tiny-gemma3")
    parser.add_argument("switches", help="comma-separated fast_paths fields, e.g. packed_fp32")
    parser.add_argument("rounds", nargs="?", type=int, default=8)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    main(args.model, args.switches.split(","), args.rounds, getattr(torch, args.dtype))
