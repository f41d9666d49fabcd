"""A step's fixed cost: one request decoding alone, the engine's step against transformers' ``generate`` per token.

    .venv/bin/python scripts/one_row_step_cost.py [--model tiny-gemma3] [--widen 1] [--new 64] [--rounds 10]

One request of 100 tokens then ``--new`` greedy tokens, one torch thread, CPU time; the engine and ``generate`` (sdpa
where the model supports it) alternate, and each side's fastest round is kept. With one row, a step is nearly all
per-step cost (op dispatch, step building, scheduling), so this is the floor a step pays on this machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hybridkv.bench.hf_baselines import fast_attention
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import build_random, quiet_transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gemma3")
    parser.add_argument("--widen", type=int, default=1)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompt = list(range(3, 103))
    with quiet_transformers():
        model, config = build_random(args.model, args.widen)
        fast, attention = fast_attention(args.model, args.widen)
    engine = Engine(
        config,
        model,
        EngineConfig(gpu_memory="256MiB", page_size=16, chunk_size=64, max_context=len(prompt) + args.new),
    )
    ids = torch.tensor([prompt])

    def engine_pass() -> list[int]:
        engine.clear_cache()
        return engine.generate([prompt], args.new, stop_at_eos=False)[0].output_ids

    def hf_pass() -> list[int]:
        with torch.inference_mode():
            out = fast.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
        return out[0, len(prompt) :].tolist()

    best = {"engine": float("inf"), "transformers": float("inf")}
    outputs = {}
    for side, run in (("engine", engine_pass), ("transformers", hf_pass)):
        outputs[side] = run()  # warm-up
    for _ in range(args.rounds):
        for side, run in (("engine", engine_pass), ("transformers", hf_pass)):
            start = time.process_time()
            run()
            best[side] = min(best[side], time.process_time() - start)
    per_token = {side: round(1e3 * s / args.new, 3) for side, s in best.items()}
    print(
        json.dumps(
            {
                "model": args.model,
                "widen": args.widen,
                "hf_attention": attention,
                "ms_per_token": per_token,
                "engine_over_transformers": round(best["engine"] / best["transformers"], 3),
                "same_tokens": outputs["engine"] == outputs["transformers"],
            }
        )
    )


if __name__ == "__main__":
    main()
