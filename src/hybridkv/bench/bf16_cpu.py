"""``hybridkv bench bf16``: the engine in bf16 on the CPU with its fast paths and without them, in one run.

Fast paths (``engine.fast_paths``): packed bf16 linears (``engine.layers.linear``: every projection,
the logits and routed experts through oneDNN with the weights reordered once), recurrent states kept
in place (GatedDeltaNet, KDA decodes; the step's state cells), bf16 RMS norms scaled in place, the C++
kernels (the greedy choice), paged decode attention (``ops.paged_decode``), flushed GatedDeltaNet decays
(``ops.gated_delta``), fp32 conv taps (``ops.conv``), dense experts of few tokens (``layers.dense_moe``), the
fused RMS norm (+ residual add, or GatedDeltaNet's SiLU gate), the fused gated activation and the fused q/k norm
and rotation (``ops.rms_norm``, ``ops.gated_act``, ``ops.qk_rope``), the chunked gated delta rule's bf16 products
(``ops.delta_chunks``) and the other ``fast_paths`` switches. The baseline is the same engine, the same weights and
requests, with every one turned off (``fast_paths(False)``); ``bit-equal`` has every one on but those that round
differently (``fast_paths.ROUNDING``); ``unfused`` every one on but the fused kernels (``FUSED``; their gain:
``fused_gain``, ``unfused`` over ``fast``); ``fast`` has every one on. Changes that are not switches (the
rope's rotate-half as slices) are in all four.

Workloads (``WORKLOADS``), random prompts (seeded), every request generating exactly its new tokens
(greedy, EOS does not stop): ``prefill-heavy`` 16 prompts of 200 tokens, 32 new each; ``decode-heavy``
32 prompts of 16 tokens, 64 new each. One engine per model (bf16, the widened tiny random model;
``gpu_memory`` 512 MiB, chunks of 512, 2048 tokens a step), its prefix cache cleared before each pass.

Per model and workload: ``rounds`` alternating rounds (the starting contender rotates), one torch
thread, after one untimed pass of each contender (the packed weights are made there); each
contender's fastest round: CPU seconds (``time.process_time``: the machine may be shared), new
tokens per CPU second, CPU µs per new token, the speedup of ``fast`` over the baseline, and ``same``:
requests whose tokens equal the baseline's (all of them for ``bit-equal``; ``fast``'s paged attention is within
bf16's rounding of the baseline's, and greedy tokens of a bf16 model drift apart after a few dozen steps
either way: on tiny-gemma3, 32 x 64 new tokens, both agree with fp32's for ~31-33 tokens on average).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.fast_paths import ROUNDING, FastPaths, fast_paths
from hybridkv.engine.random_models import VOCAB, build_random, quiet_transformers

WORKLOADS: dict[str, tuple[int, int, int]] = {
    "prefill-heavy": (16, 200, 32),  # requests, prompt tokens, new tokens each
    "decode-heavy": (32, 16, 64),
}


FUSED = ("fused_norms", "fused_activations", "fused_rope")
"""The fused kernels (norm + residual add, gated activation, q/k norm + rotation): off in ``unfused``."""
FAST_PATHS = ", ".join(f.name.replace("_", " ") for f in dataclasses.fields(FastPaths))
CONTENDERS: dict[str, Callable[[], contextlib.AbstractContextManager[FastPaths]]] = {
    "baseline": lambda: fast_paths(False),  # the engine without its CPU fast paths
    "bit-equal": lambda: fast_paths(True, **dict.fromkeys(ROUNDING, False)),  # those that compute the baseline's bits
    "unfused": lambda: fast_paths(True, **dict.fromkeys(FUSED, False)),
    "fast": lambda: fast_paths(True),
}


def prompts(requests: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(requests)]


def _pass(engine: Engine, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    engine.clear_cache()
    start = time.process_time()
    outs = engine.generate(batch, new, stop_at_eos=False)
    return time.process_time() - start, [o.output_ids for o in outs]


def run(models: list[str], widen: int = 8, rounds: int = 3, workloads: list[str] | None = None) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        for name in models:
            with quiet_transformers():
                model, config = build_random(name, widen)
            engine = Engine(
                config,
                model,
                EngineConfig(gpu_memory="512MiB", dtype=torch.bfloat16, chunk_size=512, max_step_tokens=2048),
            )
            try:
                for workload in workloads or list(WORKLOADS):
                    rows.append({"model": name, "workload": workload, **_workload(engine, workload, rounds)})
            finally:
                engine.close()
        return {"widen": widen, "rounds": rounds, "fast_paths": FAST_PATHS, "workloads": WORKLOADS, "rows": rows}
    finally:
        torch.set_num_threads(threads)


def _workload(engine: Engine, workload: str, rounds: int) -> dict[str, Any]:
    requests, length, new = WORKLOADS[workload]
    batch = prompts(requests, length)
    tokens: dict[str, list[list[int]]] = {}
    for label, mode in CONTENDERS.items():  # untimed: packed weights made, buffers grown
        with mode():
            tokens[label] = _pass(engine, batch, new)[1]
    cpu: dict[str, list[float]] = {label: [] for label in CONTENDERS}
    labels = list(CONTENDERS)
    for r in range(rounds):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            with CONTENDERS[label]():
                seconds, got = _pass(engine, batch, new)
            cpu[label].append(seconds)
            tokens[label] = got
    generated = requests * new
    out: dict[str, Any] = {"requests": requests, "prompt_tokens": length, "new_tokens": new, "contenders": {}}
    for label in labels:
        best = min(cpu[label])
        out["contenders"][label] = {
            "cpu_s": best,
            "cpu_rounds": cpu[label],
            "tokens_per_cpu_s": generated / best,
            "cpu_us_per_token": 1e6 * best / generated,
            "same": sum(a == b for a, b in zip(tokens[label], tokens["baseline"], strict=True)),
        }
    out["speedup"] = min(cpu["baseline"]) / min(cpu["fast"])
    out["fused_gain"] = min(cpu["unfused"]) / min(cpu["fast"])
    return out
