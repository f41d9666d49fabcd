"""Time to first token of a prefix restored from host memory or the Mooncake Store vs recomputed.

    .venv/bin/python scripts/tier_ttft.py [--model tiny-qwen3-next] [--tokens 480] [--rounds 7]

One engine (host memory + the Mooncake Store on a loopback master). Each round takes a new
cache salt (nothing below the device knows it yet) and serves the same prompt four times,
one token each: computed from scratch, then after the device's cache went to host memory
(restored from host), then after host memory went to the store (restored from the store),
then with the prefix on the device again. Rounds alternate in one process; medians printed as
one JSON object, with each output checked equal to the recomputed one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import build_random


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen3-next")
    ap.add_argument("--tokens", type=int, default=480)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    hf, config = build_random(args.model)
    engine = Engine(
        config,
        hf,
        EngineConfig(gpu_memory="64MiB", page_size=16, chunk_size=64, host_memory="256MiB", store="mooncake"),
    )
    ids = torch.randint(3, 256, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    times: dict[str, list[float]] = {"recompute": [], "host": [], "storage": [], "device": []}
    cached: dict[str, int] = {}
    try:
        for _ in range(args.rounds):
            salt = uuid.uuid4().hex
            first = None
            for side in times:
                if side == "host":
                    engine.clear_cache()
                elif side == "storage":
                    engine.clear_cache(host=True)
                start = time.perf_counter()
                out = engine.generate([ids], 1, cache_salts=[salt])[0]
                times[side].append(time.perf_counter() - start)
                first = out.output_ids if first is None else first
                assert out.output_ids == first, f"{side}: tokens differ"
                cached[side] = out.cached_tokens_details["device" if side == "recompute" else side]
        ms = {k: round(1000 * statistics.median(v), 2) for k, v in times.items()}
        assert engine.tiers is not None
        report = {
            "model": args.model,
            "prompt_tokens": args.tokens,
            "rounds": args.rounds,
            "ttft_ms_median": ms,
            "restored_tokens": cached,
            "ratio_to_recompute": {k: round(v / ms["recompute"], 3) for k, v in ms.items()},
            "loaded_bytes": engine.tiers.metrics()["loaded_bytes"],
        }
        print(json.dumps(report))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
