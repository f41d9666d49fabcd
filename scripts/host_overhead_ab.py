"""A/B of two source trees of hybridkv on the engine's steps, alternating processes (issue #35: per-step host time).

Each round runs one child process per tree (order alternating): a tiny random model widened x8 with a 32k
vocabulary, bf16, one thread; ``ROWS`` random prompts of 144 tokens submitted at once, 16 new tokens each (greedy,
EOS ignored), ``REPS`` times after two warm-up runs. A child reports the CPU time of its thread (``time.thread_time``:
less sensitive than wall time to other processes on a shared machine) of a whole run and of its decode steps
(median and 10th percentile), and a digest of every token and, with ``--check``, of every step's logits (bit for bit).
The parent prints each round, the per-round ratios new/base and their median, and whether the digests agree.

    git archive <base-commit> src | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 .venv/bin/python scripts/host_overhead_ab.py /tmp/base/src src --rows 1 --reps 5 --rounds 6
    OMP_NUM_THREADS=1 .venv/bin/python scripts/host_overhead_ab.py /tmp/base/src src --rows 64 --reps 2 --check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

METRICS = ("total_ms", "decode_ms", "p10_ms")


def child(model: str, rows: int, reps: int, check: bool) -> None:
    """One tree's figures, as one JSON line on stdout."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridkv.engine.config import EngineConfig
    from hybridkv.engine.engine import Engine
    from hybridkv.engine.random_models import random_config
    from hybridkv.engine.sched.request import SamplingParams

    torch.set_num_threads(1)
    cfg = random_config(model, 8)
    cfg.vocab_size = 32000
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    options = EngineConfig(
        gpu_memory="1GiB", chunk_size=2048, max_step_tokens=2048, dtype=torch.bfloat16, max_context=512
    )
    engine = Engine(cfg, hf, options)
    logits_digest = hashlib.md5()
    if check:
        forward = engine.runner.forward

        def digesting(batch):  # type: ignore[no-untyped-def]
            out = forward(batch)
            logits_digest.update(out.float().numpy().tobytes())
            return out

        engine.runner.forward = digesting  # type: ignore[method-assign]

    def run(seed: int) -> tuple[float, list[float], list[int]]:
        rng = random.Random(seed)
        for _ in range(rows):
            prompt = [rng.randrange(3, cfg.vocab_size) for _ in range(144)]
            engine.submit(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))
        steps, tokens = [], []
        start = time.thread_time()
        while engine.has_work():
            t = time.thread_time()
            out = engine.step()
            steps.append(time.thread_time() - t)
            tokens.extend(token for _, token in out.tokens)
        return time.thread_time() - start, steps, tokens

    for seed in (100, 101):
        run(seed)
    totals, decodes, every, tokens = [], [], [], []
    for seed in range(reps):
        total, steps, chosen = run(seed)
        totals.append(total)
        decodes.append(statistics.median(steps[-15:]))
        every += steps[-15:]
        tokens.append(chosen)
    every.sort()
    print(
        json.dumps(
            {
                "total_ms": statistics.median(totals) * 1e3,
                "decode_ms": statistics.median(decodes) * 1e3,
                "p10_ms": every[len(every) // 10] * 1e3,
                "tokens": hashlib.md5(str(tokens).encode()).hexdigest()[:12],
                "logits": logits_digest.hexdigest()[:12] if check else None,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", help="the base tree's src directory")
    parser.add_argument("new", help="the new tree's src directory")
    parser.add_argument("--model", default="tiny-gemma3")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--check", action="store_true", help="digest every step's logits too (slower)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.rows, args.reps, args.check)
        return
    trees = {"base": os.path.abspath(args.base), "new": os.path.abspath(args.new)}
    results: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
    command = [sys.executable, __file__, args.base, args.new, "--child", "--model", args.model]
    command += ["--rows", str(args.rows), "--reps", str(args.reps)] + (["--check"] if args.check else [])
    for r in range(args.rounds):
        for side in ("base", "new") if r % 2 == 0 else ("new", "base"):
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=trees[side])
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            results[side].append(figures)
            print(r, side, " ".join(f"{k} {figures[k]:.2f}" for k in METRICS), figures["tokens"], figures["logits"])
    for m in METRICS:
        ratios = [float(n[m]) / float(b[m]) for b, n in zip(results["base"], results["new"], strict=True)]
        print(f"{m}: new/base per round {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")
    same = all(
        b["tokens"] == n["tokens"] and b["logits"] == n["logits"] for b, n in zip(*results.values(), strict=True)
    )
    print("tokens" + (" and logits" if args.check else "") + " equal:", same)


if __name__ == "__main__":
    main()
