"""Engine: serve token prompts with a real model over UnifiedMemory (continuous batching).

``Engine(config, weights, gpu_memory=..., page_size=..., chunk_size=...)`` builds the spec
from the config, sizes the memory, loads the weights, and ``generate`` runs every prompt
to ``max_new_tokens`` or EOS, greedy by default (seeded sampling with ``temperature > 0``).
With ``prefix_cache`` (the default) requests go through a ``HybridRadixCache`` that lives as
long as the engine: a prompt that shares a cached prefix (in its cache salt's namespace)
starts computing at the hit's end; each output reports its ``cached_tokens`` and the hit per
component.

Invariants:
- Bad requests (empty, ids outside the vocabulary, longer than the model's context) fail
  alone with an error naming the problem; the others run as if they were not there.
- After ``generate`` returns, no request holds memory (every handle released): the memory
  holds only what the cache keeps (nothing after ``clear_cache``), and ``verify()`` holds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridkv.cache import HybridRadixCache
from hybridkv.cache.placement import engine_default
from hybridkv.engine.allocator import CacheHit, RequestAllocator
from hybridkv.engine.registry import architectures, text_config
from hybridkv.engine.runner import ModelRunner
from hybridkv.engine.sampling import choose_tokens
from hybridkv.engine.scheduler import Request, Scheduler, Step
from hybridkv.engine.weights import build_model, read_config, read_safetensors
from hybridkv.memory import UnifiedMemory, parse_bytes
from hybridkv.spec import ModelSpec, ShardSpec, dtype_name, from_hf_config


def engine_spec(config: Any, dtype: torch.dtype = torch.float32, name: str | None = None) -> ModelSpec:
    """The spec of a ``transformers`` config served in ``dtype``: K/V and conv windows (activations) in
    ``dtype``, recurrent matrices as the config says (fp32 by default); see ``hybridkv.spec.from_hf_config``."""
    return from_hf_config({**text_config(config).to_dict(), "dtype": dtype_name(dtype)}, name=name)


@dataclass(frozen=True)
class Output:
    output_ids: list[int]
    finish_reason: str  # "length", "eos" or "error"
    error: str | None = None
    retractions: int = 0
    cached_tokens: int = 0
    """Tokens of the prompt served from the prefix cache at the first admission (not computed)."""
    hit: CacheHit | None = None
    """The first admission's match per component (full / window / checkpoint lengths)."""


class Engine:
    def __init__(
        self,
        spec_or_config: Any,
        weights: Mapping[str, torch.Tensor] | Any | str | Path | None = None,
        *,
        gpu_memory: int | str = "256MiB",
        page_size: int = 16,
        chunk_size: int = 64,
        max_running: int = 64,
        max_step_tokens: int | None = None,
        max_context: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        spec: ModelSpec | None = None,
        prefix_cache: bool = True,
        cache_policy: str = "lru",
        checkpoints: str | None = None,
    ):
        """``spec_or_config``: a ``transformers`` config, or a directory holding ``config.json``
        (and, when ``weights`` is None, the ``*.safetensors``). ``weights``: HF-named tensors, a
        ``transformers`` model, or a directory. ``spec`` overrides the spec derived from the config.
        ``checkpoints``: where requests store recurrent-state checkpoints for later hits, a
        placement spec (``hybridkv.cache.placement``: none, interval:N, prompt-aligned[:K],
        branch, end; default ``engine_default``: every page-aligned chunk end, the prompt end,
        the branch point, the sequence end); prefill chunks end at the positions it asks for."""
        config = spec_or_config
        if isinstance(config, ModelSpec):
            raise TypeError(
                "Engine needs the model's transformers config (its layers are built from it); "
                "pass a ModelSpec as spec=... next to the config"
            )
        if isinstance(config, str | Path):
            weights = config if weights is None else weights
            config = read_config(config)
        if weights is None:
            raise ValueError("give weights: a state_dict, a transformers model or a safetensors directory")
        tensors: Mapping[str, torch.Tensor]
        if isinstance(weights, str | Path):
            tensors = read_safetensors(weights)
        elif hasattr(weights, "state_dict"):
            tensors = weights.state_dict()
        else:
            tensors = weights
        self.config = text_config(config)
        if self.config.model_type not in architectures():
            raise ValueError(
                f"the engine has no model for model_type {self.config.model_type!r}; it serves {architectures()}"
            )
        self.spec = spec or engine_spec(self.config, dtype)
        self.max_context = max_context or self.spec.max_context
        self.mem = UnifiedMemory.create(
            ShardSpec.whole(self.spec),
            parse_bytes(gpu_memory),
            device,
            page_size=page_size,
            max_context=self.max_context,
            chunk_tokens=chunk_size,
        )
        self.runner = ModelRunner(build_model(self.config, tensors, dtype, device), self.mem)
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens or 4 * chunk_size
        eos = getattr(self.config, "eos_token_id", None)
        self.eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.alloc = RequestAllocator(
            self.mem,
            prefix_cache=prefix_cache,
            cache_policy=cache_policy,
            checkpoints=checkpoints or engine_default(chunk_size, page_size),
        )
        self.stats = dict.fromkeys(
            ["steps", "retractions", "forward_tokens", "prompt_tokens", "cached_tokens", "resumed_cached_tokens"], 0
        )

    @property
    def cache(self) -> HybridRadixCache:
        return self.alloc.cache

    def clear_cache(self) -> None:
        """Evict everything the prefix cache holds (no request runs between ``generate`` calls)."""
        self.alloc.clear_cache()

    def check(self, prompt: list[int], max_new: int) -> str | None:
        """Why the engine cannot serve ``prompt`` with ``max_new`` new tokens (None: it can)."""
        vocab = self.runner.model.vocab_size
        if not prompt:
            return "empty prompt: give at least one token"
        ids = np.asarray(prompt)
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab:
            bad = [t for t in prompt if not isinstance(t, int | np.integer) or not 0 <= t < vocab]
            return f"token ids {bad[:5]} outside the vocabulary [0, {vocab})"
        if len(prompt) + max_new > self.max_context:
            return (
                f"prompt of {len(prompt)} tokens + {max_new} new exceeds the context of {self.max_context} tokens; "
                "shorten the prompt or lower max_new_tokens"
            )
        return None

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        *,
        temperature: float = 0.0,
        seed: int = 0,
        stop_at_eos: bool = True,
        cache_salts: list[Hashable] | None = None,
        on_output: Callable[[int, Output], None] | None = None,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[Output]:
        """Outputs in input order; requests are batched continuously, prefills chunked.

        ``cache_salts[i]``: request ``i``'s prefix-cache namespace (requests of different salts never
        share cached KV; default None for all). ``on_output(index, output)`` is called as each
        request ends (finished or failed), e.g. for progress; ``on_token(index, token)`` as each
        token is chosen, right after the step that computed it (e.g. to time the first token)."""
        news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        salts = [None] * len(prompts) if cache_salts is None else list(cache_salts)
        if len(salts) != len(prompts):
            raise ValueError(f"{len(salts)} cache salts for {len(prompts)} prompts; give one per prompt or none")
        sched = Scheduler(self.alloc, self.chunk_size, self.max_running, self.max_step_tokens)
        results: dict[int, Output] = {}

        def end(index: int, out: Output) -> None:
            results[index] = out
            if on_output is not None:
                on_output(index, out)

        for i, (prompt, max_new, salt) in enumerate(zip(prompts, news, salts, strict=True)):
            error = self.check(list(prompt), max_new)
            if error is not None:
                end(i, Output([], "error", f"request {i}: {error}"))
            elif max_new <= 0:
                end(i, Output([], "length"))
            else:
                eos = self.eos if stop_at_eos else frozenset()
                sched.add(Request(i, list(prompt), max_new, temperature, seed + i, eos, salt))
                self.stats["prompt_tokens"] += len(prompt)
        while sched.has_work():
            step = sched.next_step()
            done: list[Request] = []
            if step is not None:
                sample = self._forward(step)
                if on_token is not None:
                    for req, token in zip(step.reqs, sample, strict=True):
                        if token is not None:
                            on_token(req.index, token)
                done = sched.complete(step, sample)
            for req in done:
                out = Output(req.output, req.finish_reason or "length", None, req.retractions, *self._hit(req))
                end(req.index, out)
            for req in sched.failed:
                end(req.index, Output([], "error", req.error, req.retractions, *self._hit(req)))
            sched.failed.clear()
        self.stats["retractions"] += sched.retractions
        return [results[i] for i in range(len(prompts))]

    def _hit(self, req: Request) -> tuple[int, CacheHit | None]:
        """The first admission's hit, counted in ``stats`` (later admissions, after retraction, apart)."""
        hit = req.mem.hit
        cached = 0 if hit is None else hit.cached_tokens
        self.stats["cached_tokens"] += cached
        self.stats["resumed_cached_tokens"] += req.mem.cached_tokens - cached
        return cached, hit

    def _forward(self, step: Step) -> list[int | None]:
        """Run one step; the chosen token of each request whose span reached its end (None mid-prefill)."""
        logits = self.runner.forward(step.batch)
        self.stats["steps"] += 1
        self.stats["forward_tokens"] += int(step.batch.input_ids.size)
        rows = [i for i, req in enumerate(step.reqs) if req.computed + step.spans[i] == len(req.tokens)]
        sample: list[int | None] = [None] * len(step.reqs)
        if rows:
            reqs = [step.reqs[i] for i in rows]
            picked = choose_tokens(
                logits[rows], [r.temperature for r in reqs], [r.seed for r in reqs], [len(r.tokens) for r in reqs]
            )
            for i, token in zip(rows, picked, strict=True):
                sample[i] = token
        return sample
