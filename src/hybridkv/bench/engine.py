"""``hybridkv bench engine``: the engine's tokens/s against ``transformers`` ``generate``, per architecture.

Workload: whole conversations of the Mooncake conversation trace (requests that share their
first two prefix blocks; each at most ``MAX_BLOCKS`` blocks), taken in order of first arrival
until ``requests`` are chosen, kept in arrival order. Scaled down: a 512-token block becomes
``block_tokens`` token ids of the tiny vocabulary, drawn from a generator seeded by the block
hash, so requests sharing blocks share token prefixes (about 58% of the blocks of the default
64 requests repeat an earlier one). Every request generates exactly ``max_new_tokens`` (EOS does
not stop either side), greedy.

Measured in one process, one torch thread, same run, per tiny random model:
- ``engine``: ``Engine.generate`` on all requests at once (continuous batching, chunked prefill,
  the prefix cache on unless ``prefix_cache=False``, state checkpoints where ``checkpoints``
  places them; the cache is cleared before each pass, so hits come from earlier requests of
  the same pass), the faster of ``ENGINE_PASSES`` passes
  (both must give the same tokens); ``prefix_hit_rate``: prompt tokens served from the cache
  (first admissions) over all prompt tokens;
- ``transformers``: ``model.generate`` on the same requests one by one (its own cache);
- ``hybridkv_share``: wall time inside hybridkv memory, cache and allocator calls (``UnifiedMemory``,
  ``KVManager``, ``HybridRadixCache`` and ``RequestAllocator`` methods, outermost calls only,
  ``perf_counter``) over the engine's time.
Both produce the same tokens (``exact`` counts the requests where they do).

Goals: engine >= 5x transformers' tokens/s, and hybridkv calls <= 10% of the engine's step time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from hybridkv.cache import HybridRadixCache, KVManager
from hybridkv.cache.placement import engine_default
from hybridkv.engine.allocator import RequestAllocator
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import CONTEXT, VOCAB, build_random, quiet_transformers, tiny_names
from hybridkv.memory import UnifiedMemory
from hybridkv.traces import MOONCAKE_TRACE, load_mooncake_trace

GOAL_SPEEDUP = 5.0
GOAL_SHARE = 0.10
MAX_BLOCKS = 64
ENGINE_PASSES = 2  # the engine's faster pass is reported (the machine may be shared); transformers runs once
FIRST_TOKEN = 3  # ids below are special tokens (pad / bos / eos) in the tiny models


def conversation_prompts(
    requests: int, block_tokens: int, vocab: int = VOCAB, max_tokens: int | None = None
) -> list[list[int]]:
    """Token prompts of the first ``requests`` requests of whole multi-turn conversations (see module doc);
    ``ValueError`` before building any when a prompt would exceed ``max_tokens``."""
    conversations: dict[tuple[int, ...], list[int]] = defaultdict(list)
    trace = load_mooncake_trace(MOONCAKE_TRACE)
    for i, req in enumerate(trace):
        if 2 <= len(req.hash_ids) <= MAX_BLOCKS:
            conversations[req.hash_ids[:2]].append(i)
    chosen: list[int] = []
    for members in conversations.values():
        if len(members) >= 2:
            chosen += members[: requests - len(chosen)]
        if len(chosen) == requests:
            break
    if len(chosen) < requests:
        raise ValueError(f"the trace holds only {len(chosen)} requests of shared conversations; ask for fewer")
    blocks_max = max(len(trace[i].hash_ids) for i in chosen)
    if max_tokens is not None and blocks_max * block_tokens > max_tokens:
        raise ValueError(
            f"--block-tokens {block_tokens} makes prompts of up to {blocks_max * block_tokens} tokens "
            f"({blocks_max} blocks), beyond the {max_tokens} the tiny models hold with the new tokens; "
            f"use --block-tokens {max(max_tokens // blocks_max, 1)} or less (or fewer --max-new-tokens)"
        )
    blocks: dict[int, list[int]] = {}
    prompts = []
    for i in sorted(chosen):
        ids: list[int] = []
        for h in trace[i].hash_ids:
            if h not in blocks:
                rng = np.random.default_rng(h)
                blocks[h] = rng.integers(FIRST_TOKEN, vocab, block_tokens).tolist()
            ids += blocks[h]
        prompts.append(ids)
    return prompts


class CallTimer:
    """Wall time spent inside the methods of some classes, counting only outermost calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.by_name: dict[str, float] = defaultdict(float)
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__qualname__

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.seconds += spent
                self.by_name[name] += spent
                self.calls += 1
                self._depth -= 1

        return timed

    def top(self, n: int = 4) -> dict[str, float]:
        """The ``n`` methods that took the most time, in seconds."""
        return {k: round(v, 4) for k, v in sorted(self.by_name.items(), key=lambda kv: -kv[1])[:n]}

    @contextlib.contextmanager
    def patch(self, *classes: type) -> Iterator[CallTimer]:
        """Time every public method of ``classes`` while inside the block."""
        saved = []
        for cls in classes:
            for name, fn in vars(cls).items():
                if not name.startswith("_") and inspect.isfunction(fn):
                    saved.append((cls, name, fn))
                    setattr(cls, name, self.wrap(fn))
        try:
            yield self
        finally:
            for cls, name, fn in saved:
                setattr(cls, name, fn)


def bench_model(
    name: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    gpu_memory: str | int,
    page_size: int,
    chunk_size: int,
    prefix_cache: bool = True,
    checkpoints: str | None = None,
    max_context: int | None = None,
) -> dict[str, Any]:
    hf, config = build_random(name)
    engine = Engine(
        config,
        hf,
        gpu_memory=gpu_memory,
        max_context=max_context,
        page_size=page_size,
        chunk_size=chunk_size,
        prefix_cache=prefix_cache,
        checkpoints=checkpoints,
    )
    engine.generate(prompts[:2], 2, stop_at_eos=False)  # warm-up: first-call allocations
    passes = []
    for _ in range(ENGINE_PASSES):
        engine.clear_cache()  # each pass hits only on what its own earlier requests cached
        steps_before = engine.stats["steps"]
        timer = CallTimer()
        with timer.patch(UnifiedMemory, KVManager, HybridRadixCache, RequestAllocator):
            start = time.perf_counter()
            outs = engine.generate(prompts, max_new_tokens, stop_at_eos=False)
            engine_s = time.perf_counter() - start
        passes.append((engine_s, timer, engine.stats["steps"] - steps_before, outs))
    if any([o.output_ids for o in p[3]] != [o.output_ids for o in passes[0][3]] for p in passes):
        raise RuntimeError(f"{name}: the engine's passes disagree")
    engine_s, timer, steps, outs = min(passes, key=lambda p: p[0])
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"{name}: the engine refused requests: {errors[0]}")

    reference = []
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, eos_token_id=None)  # warm-up
        start = time.perf_counter()
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
            reference.append(out[0, len(ids) :].tolist())
        hf_s = time.perf_counter() - start
    tokens = len(prompts) * max_new_tokens
    share = timer.seconds / engine_s
    return {
        "model": name,
        "tokens": tokens,
        "engine_s": round(engine_s, 3),
        "transformers_s": round(hf_s, 3),
        "engine_tokens_per_s": round(tokens / engine_s, 1),
        "transformers_tokens_per_s": round(tokens / hf_s, 1),
        "speedup": round(hf_s / engine_s, 2),
        "steps": steps,
        "step_ms": round(1000 * engine_s / steps, 3),
        "hybridkv_calls": timer.calls,
        "hybridkv_s": round(timer.seconds, 4),
        "hybridkv_share": round(share, 4),
        "hybridkv_top_s": timer.top(),
        "prefix_cache": prefix_cache,
        "cached_tokens": sum(o.cached_tokens for o in outs),
        "prefix_hit_rate": round(sum(o.cached_tokens for o in outs) / sum(map(len, prompts)), 4),
        "exact": sum(o.output_ids == r for o, r in zip(outs, reference, strict=True)),
        "speedup_met": hf_s / engine_s >= GOAL_SPEEDUP,
        "share_met": share <= GOAL_SHARE,
    }


def bench_prompts(requests: int, block_tokens: int, max_new_tokens: int) -> list[list[int]]:
    """The benchmark's prompts (``conversation_prompts``, each short enough for ``max_new_tokens`` more within
    the tiny models' context)."""
    return conversation_prompts(requests, block_tokens, max_tokens=CONTEXT - max_new_tokens)


def run(
    models: list[str] | None = None,
    requests: int = 64,
    max_new_tokens: int = 16,
    block_tokens: int = 4,
    gpu_memory: str | int = "256MiB",
    page_size: int = 16,
    chunk_size: int = 64,
    prefix_cache: bool = True,
    checkpoints: str | None = None,
    max_context: int | None = None,
) -> dict[str, Any]:
    models = models or tiny_names()
    checkpoints = checkpoints or engine_default(chunk_size, page_size)
    unknown = sorted(set(models) - set(tiny_names()))
    if unknown:
        raise ValueError(f"unknown models {unknown}; choose from {tiny_names()}")
    prompts = bench_prompts(requests, block_tokens, max_new_tokens)
    lengths = [len(p) for p in prompts]
    with quiet_transformers():  # its "falling back to the reference implementation" notes: expected here
        rows = [
            bench_model(
                m, prompts, max_new_tokens, gpu_memory, page_size, chunk_size, prefix_cache, checkpoints, max_context
            )
            for m in models
        ]
    return {
        "requests": requests,
        "prompt_tokens": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
        "max_new_tokens": max_new_tokens,
        "block_tokens": block_tokens,
        "page_size": page_size,
        "chunk_size": chunk_size,
        "prefix_cache": prefix_cache,
        "checkpoints": checkpoints,
        "goals": {"speedup": GOAL_SPEEDUP, "hybridkv_share": GOAL_SHARE},
        "models": rows,
    }
