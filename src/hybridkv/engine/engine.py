"""Engine: serve token prompts with a real model over UnifiedMemory (continuous batching, one process).

``Engine(model, weights, EngineConfig(gpu_memory=..., page_size=..., chunk_size=...))`` builds the
spec from the model's config, sizes the memory, loads the weights and owns one ``Scheduler``
(``Role.WHOLE``); ``engine.options`` is the ``EngineConfig`` it was built from. Two ways to drive it:

- incremental, for servers: ``rid = engine.submit(prompt, SamplingParams(...))`` (validated at
  once: ``RequestError`` names the field), then ``engine.step()`` until ``has_work()`` is False;
  each step returns the tokens it chose and the requests that ended (``Outcome``);
  ``engine.abort(rid)`` ends a request between steps (its memory released at once);
- batch: ``engine.generate(prompts, max_new_tokens)`` submits every prompt and steps until
  they end, returning ``Outcome`` in input order (a bad prompt fails alone as an ``error`` output).

With ``prefix_cache`` (the default) requests go through a ``HybridRadixCache`` that lives as
long as the engine: a prompt that shares a cached prefix (in its cache salt's namespace)
starts computing at the hit's end; each output reports its ``cached_tokens`` and the hit per
component.

With ``host_memory`` and/or ``store`` (``mooncake``: the Mooncake Store; a loopback master is
started unless ``store_master`` names one) the cache has tiers below it (``EngineTiers``):
what the device evicts is written back to host memory, what host memory evicts to the store,
and a request's hit is the longest prefix whose every component (full KV, windows, state) is
on some tier, restored before it computes. Outputs split ``cached_tokens`` into
``cached_tokens_details`` {device, host, storage}. ``close`` stops the tiers (and the master).

Invariants:
- Bad requests are refused at ``submit`` (``check_request``) and never reach the scheduler; a
  ``CheckedPrompt`` (a server's backend checked it) is not checked again.
- When ``has_work()`` is False no request holds memory: the memory holds only what the cache
  keeps (nothing after ``clear_cache``), and ``verify()`` holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridkv.cache import HybridRadixCache
from hybridkv.engine.config import DEFAULT_CONFIG, EngineConfig
from hybridkv.engine.forward.pool_io import pool_layouts
from hybridkv.engine.host_malloc import keep_freed_host_memory
from hybridkv.engine.logprobs import TokenLogprob, prompt_logprobs
from hybridkv.engine.registry import architectures, engine_spec, eos_ids, text_config
from hybridkv.engine.runner import ShardRunner
from hybridkv.engine.sched.kv import RequestKV
from hybridkv.engine.sched.request import (
    CheckedPrompt,
    FinishReason,
    Outcome,
    Request,
    RequestError,
    SamplingParams,
    check_request,
)
from hybridkv.engine.sched.scheduler import Scheduler, Step, choose_step_tokens, step_logprobs
from hybridkv.engine.sched.tiered import ZERO_DETAILS
from hybridkv.engine.weights import build_model, read_config, read_safetensors
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import ModelSpec, ShardSpec


@dataclass(frozen=True)
class StepOutput:
    """What one ``Engine.step`` produced: ``(rid, token)`` for every token chosen, in order, and
    every request that ended (finished, aborted or failed)."""

    tokens: list[tuple[Hashable, int]] = field(default_factory=list)
    finished: list[Outcome] = field(default_factory=list)
    logprobs: dict[Hashable, TokenLogprob] = field(default_factory=dict)
    """The log-probability of the token each request that asks (``params.logprobs``) got this step."""


class Engine:
    def __init__(
        self,
        model: Any,
        weights: Mapping[str, torch.Tensor] | Any | str | Path | None = None,
        config: EngineConfig = DEFAULT_CONFIG,
    ):
        """``model``: a ``transformers`` config, or a directory holding ``config.json`` (and, when
        ``weights`` is None, the ``*.safetensors``). ``weights``: HF-named tensors, a ``transformers``
        model, or a directory. ``config``: the engine's sizes and options (``EngineConfig``, checked when
        it was built); there is no keyword path: one set of fields, checked once, that mypy verifies."""
        if isinstance(model, ModelSpec):
            raise TypeError(
                "Engine needs the model's transformers config (its layers are built from it); "
                "pass a ModelSpec as spec=... of its EngineConfig, next to the model's config"
            )
        if isinstance(model, str | Path):
            weights = model if weights is None else weights
            model = read_config(model)
        if weights is None:
            raise ValueError("give weights: a state_dict, a transformers model or a safetensors directory")
        tensors: Mapping[str, torch.Tensor]
        if isinstance(weights, str | Path):
            tensors = read_safetensors(weights)
        elif hasattr(weights, "state_dict"):
            tensors = weights.state_dict()
        else:
            tensors = weights
        self.options = config
        if torch.device(config.device).type == "cpu":
            keep_freed_host_memory()  # step-sized buffers reused, not page-faulted again each step
        self.config = text_config(model)
        if self.config.model_type not in architectures():
            raise ValueError(
                f"the engine has no model for model_type {self.config.model_type!r}; it serves {architectures()}"
            )
        self.spec = config.spec or engine_spec(self.config, config.dtype)
        self.max_context = config.max_context or self.spec.max_context
        self.mem = UnifiedMemory.create(
            ShardSpec.whole(self.spec),
            config.memory_bytes,
            config.device,
            page_size=config.page_size,
            max_context=self.max_context,
            chunk_tokens=config.chunk_size,
        )
        self.runner = ShardRunner(build_model(self.config, tensors, config.dtype, config.device), self.mem)
        self.eos = eos_ids(self.config)
        self.kv = RequestKV(
            self.mem,
            prefix_cache=config.prefix_cache,
            cache_policy=config.cache_policy,
            checkpoints=config.placement,
        )
        self.tiers = config.tiers(self.kv.kvm)
        self.kv.tiers = self.tiers
        self.sched = Scheduler(self.kv, config.chunk_size, config.max_running, config.step_tokens)
        self.stats = dict.fromkeys(
            [
                "steps",
                "retractions",
                "forward_tokens",
                "prompt_tokens",
                "cached_tokens",
                "cached_tokens_device",
                "cached_tokens_host",
                "cached_tokens_storage",
                "resumed_cached_tokens",
                "hit_full_tokens",
                "hit_window_tokens",
                "hit_checkpoint_tokens",
                "requests",
                "aborted",
                "errors",
            ],
            0,
        )
        self._next_rid = 0

    @property
    def cache(self) -> HybridRadixCache:
        return self.kv.cache

    @property
    def vocab_size(self) -> int:
        return int(self.runner.model.vocab_size)

    def clear_cache(self, host: bool = False) -> None:
        """Evict everything the prefix cache holds (call it while no request runs): with tiers,
        written back below. ``host``: empty host memory too, into the store below it."""
        self.kv.clear_cache()
        if self.tiers is not None:
            if host:
                self.tiers.clear_host()
            self.tiers.hierarchy.reap(wait=True)

    def reserve_step_buffers(self) -> int:
        """Grow every token pool's step buffer to the size the budget gives it (``forward.pool_io.WORKSPACE_SHARE``)
        and fault its pages in, so no step pays for growing it (a server's warm-up does, once); the bytes."""
        return sum(layout.reserve() for layout in pool_layouts(self.mem).tokens.values())

    def close(self) -> None:
        """Stop the tiers below the device (their store client, a master started here); idempotent."""
        if self.tiers is not None:
            self.tiers.close()

    def check(self, prompt: Sequence[int], max_new: int) -> str | None:
        """Why the engine cannot serve ``prompt`` with ``max_new`` new tokens (None: it can)."""
        try:
            check_request(prompt, SamplingParams(max_new_tokens=max(1, max_new)), self.vocab_size, self.max_context)
        except RequestError as exc:
            return str(exc).split(": ", 1)[1]
        return None

    # --- incremental API ----------------------------------------------------------------

    def submit(
        self,
        prompt: CheckedPrompt | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: Hashable = None,
    ) -> int:
        """Queue one request; its id. ``prompt``: a ``CheckedPrompt`` (``check_request``'s, for this engine: not
        checked again; it carries its params, so ``params`` stays None) or token ids, checked here with ``params``
        (``RequestError``, nothing queued, names what to change). ``params.seed`` None: the request id is its
        seed. ``cache_salt``: its prefix-cache namespace."""
        if isinstance(prompt, CheckedPrompt):
            if params is not None:
                raise TypeError("a CheckedPrompt carries the params it was checked with: give no params")
            checked = prompt.served_by(self.vocab_size, self.max_context)
        else:
            checked = check_request(prompt, params or SamplingParams(), self.vocab_size, self.max_context)
        rid = self._next_rid
        self._next_rid += 1
        params = checked.params.with_seed(rid)
        self.sched.add(Request(rid, checked.ids, params, params.stops(self.eos), cache_salt))
        self.stats["prompt_tokens"] += len(checked.ids)
        self.stats["requests"] += 1
        return rid

    def has_work(self) -> bool:
        return self.sched.has_work()

    def abort(self, rid: Hashable, reason: str = "aborted by the client") -> Outcome | None:
        """End a queued or running request now, its memory released; None if it is not open."""
        req = self.sched.abort(rid, reason)
        if req is None:
            return None
        self.sched.finished.remove(req)
        self.stats["aborted"] += 1
        return self._output(req)

    def step(self) -> StepOutput:
        """One scheduler step: admit, allocate, forward, choose tokens; what it produced."""
        out = StepOutput()
        if self.tiers is not None:
            self.tiers.step()
        retractions = self.sched.retractions
        step = self.sched.next_step()
        self.stats["retractions"] += self.sched.retractions - retractions
        if step is not None:
            logits = self.runner.forward(step.batch)
            if step.batch.logit_rows is not None:  # every position of these rows: their prompts' log-probabilities
                self._prompt_logprobs(step, logits[len(step.reqs) :])
                logits = logits[: len(step.reqs)]
            self.stats["steps"] += 1
            self.stats["forward_tokens"] += int(step.batch.input_ids.size)
            tokens = choose_step_tokens(step, logits)
            logprobs = step_logprobs(step, logits, tokens)
            self.sched.complete(step, tokens)
            for req, token, logprob in zip(step.reqs, tokens, logprobs, strict=True):
                if token is not None and req.finish_reason is not FinishReason.ERROR:
                    out.tokens.append((req.rid, token))
                    if logprob is not None:
                        req.logprobs.append(logprob)
                        out.logprobs[req.rid] = logprob
        for req in self.sched.take_finished():
            out.finished.append(self._output(req))
        return out

    def _prompt_logprobs(self, step: Step, logits: torch.Tensor) -> None:
        """Keep the prompt tokens' log-probabilities of the rows of ``step.batch.logit_rows`` (``logits``: their
        every position); a position computed again after a retraction keeps its first figure."""
        rows = step.batch.logit_rows
        assert rows is not None
        reqs = [step.reqs[i] for i in rows]
        starts = [int(step.batch.prefix_lens[i]) for i in rows]
        spans = [step.spans[i] for i in rows]
        tops = [r.params.prompt_logprobs or 0 for r in reqs]
        got = prompt_logprobs(logits, starts, spans, [r.prompt for r in reqs], tops)
        for req, start, logprobs in zip(reqs, starts, got, strict=True):
            known = len(req.prompt_logprobs)  # prompt tokens 1 .. known have theirs
            req.prompt_logprobs += logprobs[max(0, known - start) :]

    def _output(self, req: Request) -> Outcome:
        hit = req.hit
        cached = 0 if hit is None else hit.cached_tokens
        self.stats["cached_tokens"] += cached
        self.stats["resumed_cached_tokens"] += req.cached_tokens - cached
        if hit is not None:
            for where, n in hit.details.items():
                self.stats[f"cached_tokens_{where}"] += n
            self.stats["hit_full_tokens"] += hit.full
            self.stats["hit_window_tokens"] += hit.window
            self.stats["hit_checkpoint_tokens"] += hit.checkpoint
        if req.finish_reason is FinishReason.ERROR:
            self.stats["errors"] += 1
        reason = req.finish_reason or FinishReason.LENGTH
        output = [] if reason is FinishReason.ERROR else req.output
        logprobs = None if req.params.logprobs is None else req.logprobs[: len(output)]
        prompt_logprobs = None if req.params.prompt_logprobs is None else list(req.prompt_logprobs)
        return Outcome(
            output,
            reason,
            req.error,
            len(req.prompt),
            cached,
            cached_tokens_details=dict(ZERO_DETAILS) if hit is None else hit.details,
            hit=hit,
            retractions=req.retractions,
            rid=req.rid,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def metrics(self) -> dict[str, Any]:
        """What an operator watches: requests, memory per pool kind, cache, counters (host figures only)."""
        stats = self.mem.stats()
        cache = self.cache.stats()
        return {
            "running": len(self.sched.running),
            "waiting": len(self.sched.waiting),
            "pools": {
                str(p.pool_id): {"live": p.live_cells, "free": p.free_cells, "cached": p.cached_cells}
                for p in stats.pools
            },
            "live_pages": stats.live_pages,
            "live_slots": stats.live_slots,
            "cached_pages": self.cache.cached_pages,
            "evicted_pages": cache["evicted_pages"],
            "evicted_states": cache["evicted_states"],
            "prefix_waits": self.sched.prefix_waits,
            **self.stats,
            **({} if self.tiers is None else {"tiers": self.tiers.metrics()}),
        }

    # --- batch API ------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int] | Sequence[SamplingParams] = 16,
        *,
        temperature: float = 0.0,
        seed: int = 0,
        stop_at_eos: bool = True,
        cache_salts: Sequence[Hashable] | None = None,
        on_output: Callable[[int, Outcome], None] | None = None,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[Outcome]:
        """Outputs in input order; requests are batched continuously, prefills chunked.

        ``max_new_tokens``: one count for all, one per prompt, or one ``SamplingParams`` per prompt
        (then ``temperature``, ``seed`` and ``stop_at_eos`` are not used). Otherwise request ``i``
        samples with ``seed + i``. ``cache_salts[i]``: request ``i``'s prefix-cache namespace
        (requests of different cache salts never share cached KV). ``on_output(index, output)`` is called
        as each request ends (finished or failed); ``on_token(index, token)`` as each token is
        chosen, right after the step that computed it. A prompt the engine refuses ends at once
        as an ``error`` output naming the problem; the others run as if it were not there."""
        n = len(prompts)
        spec: list[int | SamplingParams] = (
            [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        )
        if len(spec) != n:
            raise ValueError(f"{len(spec)} max_new_tokens / params for {n} prompts; give one per prompt or one")
        per_prompt = [None] * n if cache_salts is None else list(cache_salts)
        if len(per_prompt) != n:
            raise ValueError(f"{len(per_prompt)} cache salts for {n} prompts; give one per prompt or none")
        results: dict[int, Outcome] = {}
        index: dict[Hashable, int] = {}

        def end(i: int, out: Outcome) -> None:
            results[i] = out
            if on_output is not None:
                on_output(i, out)

        for i, (prompt, what, cache_salt) in enumerate(zip(prompts, spec, per_prompt, strict=True)):
            if isinstance(what, int) and what <= 0:
                end(
                    i,
                    Outcome(
                        [], FinishReason.LENGTH, prompt_tokens=len(prompt), cached_tokens_details=dict(ZERO_DETAILS)
                    ),
                )
                continue
            try:
                params = (
                    what
                    if isinstance(what, SamplingParams)
                    else SamplingParams(what, temperature, seed=seed + i, ignore_eos=not stop_at_eos)
                )
                index[self.submit(prompt, params, cache_salt=cache_salt)] = i
            except RequestError as exc:
                why = f"request {i}: {str(exc).split(': ', 1)[1]}"
                end(i, Outcome([], FinishReason.ERROR, why, cached_tokens_details=dict(ZERO_DETAILS)))
        while len(results) < n:
            if not self.has_work():
                raise RuntimeError("the engine ran out of work with requests still open (a scheduler bug)")
            got = self.step()
            if on_token is not None:
                for rid, token in got.tokens:
                    if rid in index:
                        on_token(index[rid], token)
            for out in got.finished:
                if out.rid in index:
                    i = index.pop(out.rid)
                    error = out.error if out.error is None else f"request {i}: {out.error}"
                    end(i, dataclasses.replace(out, error=error))
        return [results[i] for i in range(n)]
