"""``hybridkv bench engine``: the engine against ``transformers``' strongest generation paths, per architecture.

Workload: whole conversations of the Mooncake conversation trace (requests that share their
first two prefix blocks; each at most ``MAX_BLOCKS`` blocks), taken in order of first arrival
until ``requests`` are chosen, kept in arrival order. Scaled down: a 512-token block becomes
``block_tokens`` token ids of the tiny vocabulary, drawn from a generator seeded by the block
hash, so requests sharing blocks share token prefixes (about 58% of the blocks of the default
64 requests repeat an earlier one). Every request generates exactly ``max_new_tokens`` (EOS does
not stop any side), greedy.

Contenders, each run once per round, ``rounds`` alternating rounds (the starting contender
rotates), one process, one torch thread, per tiny random model (``widen``: its widths times that):
- ``engine``: ``Engine.generate`` on all requests at once (continuous batching, chunked prefill,
  the prefix cache unless ``prefix_cache=False``, state checkpoints where ``checkpoints`` places
  them; the cache is cleared before each pass, so hits come from earlier requests of the pass);
- ``hf_one_by_one``: ``generate`` per request, eager attention (the exactness oracle);
- ``hf_padded_all`` / ``hf_padded_<n>``: ``generate`` on left-padded batches (all requests, then
  batches of ``padded_batch`` in order), sdpa attention where the model supports it, else eager;
- ``hf_continuous``: ``generate_batch`` (transformers' continuous batching: paged cache, block
  sharing), where it runs for the architecture (otherwise the reason is reported);
- ``engine_compiled`` (with ``compile_blocks``): a second engine whose blocks are compiled
  (``hybridkv.engine.models.compiled``), after one untimed pass that compiles them (``compile_s``).

Per contender: the fastest round's wall and CPU seconds (``time.process_time``: the machine may
be shared; CPU time counts every thread of the process), new tokens per wall and per CPU second,
*computed* tokens (positions the forwards ran on: what the engine's steps fed; for
``transformers`` every input position of every forward, padding included) and CPU µs per
computed token, and ``exact``: requests whose tokens equal the oracle's. The engine also
reports ``hybridkv_share``: CPU time inside hybridkv memory and cache calls (every method and
property of every class of ``hybridkv.memory``, ``hybridkv.cache`` and the engine's KV façade,
``KVHandle`` included; outermost calls only) over the pass's CPU time. An untimed pass with
every one of those wrapped finds the ones the engine enters hybridkv by; the timed passes wrap
only those, so hybridkv's calls inside itself run at their own cost (``record_entry_points``;
``hybridkv_share_all_wrapped`` is that pass's share, every call paying a wrapper).

Goals (the engine's fastest pass): tokens per CPU second >= ``GOAL_VS_BEST`` x the strongest
``transformers`` contender that runs; CPU per computed token <= ``GOAL_CPU_RATIO`` x that of the
cheaper padded-batch ``generate``; hybridkv share <= ``GOAL_SHARE``. The second is also judged at
the same mix of tokens (``cpu_same_mix_ratio``, same goal): the engine's CPU over what its own
computed tokens (prompt tokens, and one-token decodes: every new token but the first) cost at a
padded pass's CPU per prefill position and per decode token (``hf_baselines.PhaseClock``; the
padded contender that prices them lowest). A padded pass computes mostly prompt and padding
positions, cheap per position in one wide forward; the engine skips padding and cached prefixes,
so a quarter or more of its computed tokens are decodes, each costing a forward's per-row work:
the plain ratio compares the two mixes as much as the cost of a token. ``plain_ratio_at_hf_prices``
says how much: the plain ratio of an engine whose every computed token cost exactly the cheaper
padded pass's price for its phase (the engine's mix alone).
The ``transformers`` contenders live in ``hf_baselines``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import pkgutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import torch

from hybridkv.bench.hf_baselines import Result, continuous, fast_attention, one_by_one, padded, same_mix_cpu_s
from hybridkv.cache.placement import engine_default
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.models.compiled import compile_blocks as compiled_blocks
from hybridkv.engine.random_models import CONTEXT, VOCAB, build_random, quiet_transformers, tiny_names
from hybridkv.engine.sched.request import Outcome
from hybridkv.engine.sched.scheduler import step_budget
from hybridkv.traces import MOONCAKE_TRACE, load_mooncake_trace

GOAL_VS_BEST = 2.0
GOAL_CPU_RATIO = 1.5
GOAL_SHARE = 0.10
MAX_BLOCKS = 64
FIRST_TOKEN = 3  # ids below are special tokens (pad / bos / eos) in the tiny models
HYBRIDKV_PACKAGES = ("hybridkv.memory", "hybridkv.cache")
HYBRIDKV_MODULES = ("hybridkv.engine.sched.kv",)  # the engine's bridge to the cache: its calls count too


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
    """CPU time spent inside the methods and properties of some classes, counting only outermost calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.by_name: dict[str, float] = defaultdict(float)
        self._depth = 0

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.process_time() - start
                self.seconds += spent
                self.by_name[name] += spent
                self.calls += 1
                self._depth -= 1

        return timed

    def top(self, n: int = 4) -> dict[str, float]:
        """The ``n`` methods that took the most time, in seconds."""
        return {k: round(v, 4) for k, v in sorted(self.by_name.items(), key=lambda kv: -kv[1])[:n]}

    @contextlib.contextmanager
    def patch(self, *classes: type, only: Collection[str] | None = None) -> Iterator[CallTimer]:
        """Time every method (``__init__`` and other dunders but ``__repr__`` included; static and class methods
        too) and property of ``classes`` while inside the block; ``only``: just those labels (``Class.name``,
        as ``by_name`` keys them), every one of which must exist."""
        saved: list[tuple[type, str, Any]] = []
        missing = set(only or ())
        for cls in classes:
            for name, attr in list(vars(cls).items()):
                label = f"{cls.__name__}.{name}"
                if only is not None and label not in only:
                    continue
                missing.discard(label)
                if isinstance(attr, property) and attr.fget is not None:
                    new: Any = property(self.wrap(attr.fget, label), attr.fset, attr.fdel, attr.__doc__)
                elif isinstance(attr, staticmethod | classmethod):
                    new = type(attr)(self.wrap(attr.__func__, label))
                elif inspect.isfunction(attr) and name not in ("__repr__", "__str__"):
                    new = self.wrap(attr, label)
                else:
                    continue
                saved.append((cls, name, attr))
                setattr(cls, name, new)
        if missing:
            for cls, name, attr in saved:
                setattr(cls, name, attr)
            raise ValueError(f"no method or property {sorted(missing)} among the classes to time")
        try:
            yield self
        finally:
            for cls, name, attr in saved:
                setattr(cls, name, attr)


def hybridkv_classes() -> list[type]:
    """Every class of the hybridkv memory and cache packages and of the engine's KV façade (exceptions and enums
    aside): what the bench's hybridkv share times."""
    names = list(HYBRIDKV_MODULES)
    for package in HYBRIDKV_PACKAGES:
        names.append(package)
        names += [m.name for m in pkgutil.iter_modules(importlib.import_module(package).__path__, package + ".")]
    classes: dict[str, type] = {}
    for module_name in names:
        module = importlib.import_module(module_name)
        for cls in vars(module).values():
            if (
                inspect.isclass(cls)
                and cls.__module__ == module_name
                and not issubclass(cls, BaseException | Enum)
                and not getattr(cls, "_is_protocol", False)
            ):
                classes[f"{module_name}.{cls.__qualname__}"] = cls
    return list(classes.values())


@dataclass(frozen=True)
class Pass:
    """One contender's run of the whole workload."""

    wall_s: float
    cpu_s: float
    computed: int  # positions its forwards ran on
    outputs: list[list[int]]
    extra: dict[str, Any]


OWN_CLOCK = "own_clock"
"""A contender's ``extra`` key for the ``(wall_s, cpu_s)`` it timed itself: the engine times its ``generate`` alone, not
the bench's emptying of its cache and wrapping of the methods whose share it measures."""


def timed(run: Callable[[], Result]) -> Pass:
    wall, cpu = time.perf_counter(), time.process_time()
    outputs, computed, extra = run()
    wall, cpu = extra.pop(OWN_CLOCK, (time.perf_counter() - wall, time.process_time() - cpu))
    return Pass(wall, cpu, computed, outputs, extra)


@dataclass(frozen=True)
class EntryPoints:
    """The hybridkv methods and properties the engine enters hybridkv by in one pass of the workload (called from
    outside hybridkv), and how many such calls it makes (``record_entry_points``)."""

    labels: frozenset[str]
    calls: int
    share_all_wrapped: float  # that pass's share, every method wrapped: inflated by the nested wrappers' own cost


def _generate_timed(
    engine: Engine, prompts: list[list[int]], new: int, only: frozenset[str] | None
) -> tuple[list[Outcome], tuple[float, float], CallTimer]:
    """A pass on an emptied cache (each pass hits only on what its own earlier requests cached): its outputs, wall
    and CPU seconds and the timer of its hybridkv calls (``only``: the methods timed; None: every one)."""
    engine.clear_cache()
    timer = CallTimer()
    classes = hybridkv_classes()
    with timer.patch(*classes, only=only):  # finding and wrapping the methods is the bench's, not the pass's CPU
        wall, cpu = time.perf_counter(), time.process_time()
        outs = engine.generate(prompts, new, stop_at_eos=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"the engine refused requests: {errors[0]}")
    return outs, (wall, cpu), timer


def record_entry_points(engine: Engine, prompts: list[list[int]], new: int) -> EntryPoints:
    """One untimed pass with every method of every hybridkv class wrapped: the ones the engine enters hybridkv by.

    A timed pass wraps only those, so the calls hybridkv makes inside itself run unwrapped: a wrapper costs about
    what a small method does, and wrapping every nested call (thousands a pass) added a tenth to a fifth to the
    share measured. It runs after one plain pass, so the engine's one-time set-up (reading its pools' layouts) is behind
    it; from then on the workload is deterministic, so a timed pass makes the same outermost calls, as many
    (``engine_pass`` checks the count)."""
    engine.clear_cache()
    engine.generate(prompts, new, stop_at_eos=False)
    _, (_, cpu), timer = _generate_timed(engine, prompts, new, None)
    return EntryPoints(frozenset(timer.by_name), timer.calls, round(timer.seconds / cpu, 4))


def engine_pass(engine: Engine, prompts: list[list[int]], new: int, entries: EntryPoints | None = None) -> Result:
    """``entries``: time only those methods, and check the pass made exactly their recorded outermost calls (None:
    time every method of every hybridkv class)."""
    before = dict(engine.stats)
    outs, clock, timer = _generate_timed(engine, prompts, new, None if entries is None else entries.labels)
    if entries is not None and timer.calls != entries.calls:
        raise RuntimeError(
            f"the engine made {timer.calls} outermost hybridkv calls, not the {entries.calls} of the recording pass: "
            "the workload is not deterministic, so the share could miss calls"
        )
    cached = sum(o.cached_tokens for o in outs)
    extra = {
        "steps": engine.stats["steps"] - before["steps"],
        "hybridkv_calls": timer.calls,
        "hybridkv_s": round(timer.seconds, 4),
        "hybridkv_share": round(timer.seconds / clock[1], 4),
        "hybridkv_top_s": timer.top(8),
        "hybridkv_methods_timed": "all" if entries is None else len(entries.labels),
        "cached_tokens": cached,
        "prefix_hit_rate": round(cached / sum(map(len, prompts)), 4),
        # each new token but the first is fed back as a one-token decode; the rest of the computed are prompt tokens
        "decode_tokens": sum(max(len(o.output_ids) - 1, 0) for o in outs),
        OWN_CLOCK: clock,
    }
    if entries is not None:
        extra["hybridkv_share_all_wrapped"] = entries.share_all_wrapped
    return [o.output_ids for o in outs], engine.stats["forward_tokens"] - before["forward_tokens"], extra


def summarise(passes: list[Pass], best: Pass, tokens: int, oracle: list[list[int]]) -> dict[str, Any]:
    """A contender's fastest pass ``best`` (by CPU time), with rates and exactness."""
    wall = min(p.wall_s for p in passes)
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(best.cpu_s, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "tokens_per_cpu_s": round(tokens / best.cpu_s, 1),
        "computed_tokens": best.computed,
        "cpu_us_per_computed": round(1e6 * best.cpu_s / best.computed, 1),
        "exact": sum(a == b for a, b in zip(best.outputs, oracle, strict=True)),
        **best.extra,
    }


def _same_mix(engine: Pass, padded: Pass) -> float:
    """The engine pass's CPU over what its computed tokens cost at the padded pass's CPU per prefill position and per
    decode token (``same_mix_cpu_s``)."""
    decode = engine.extra["decode_tokens"]
    return engine.cpu_s / same_mix_cpu_s(engine.computed - decode, decode, padded.extra)


def bench_model(
    name: str,
    prompts: list[list[int]],
    new: int,
    rounds: int,
    padded_batch: int,
    engine_args: dict[str, Any],
    compile_blocks: bool = False,
    widen: int = 1,
) -> dict[str, Any]:
    dtype = engine_args.get("dtype", torch.float32)  # every contender computes in it
    oracle_model, config = build_random(name, widen)
    oracle_model.to(dtype)
    fast, attention = fast_attention(name, widen)
    fast.to(dtype)
    pad = int(getattr(config, "pad_token_id", None) or 0)
    engine = Engine(config, oracle_model, EngineConfig(**engine_args))
    entries = record_entry_points(engine, prompts, new)

    def workload_entries(p: list[list[int]], n: int) -> EntryPoints | None:
        return entries if (p, n) == (prompts, new) else None  # the warm-up's smaller pass times every method

    contenders: dict[str, Callable[[list[list[int]], int], Result]] = {
        "engine": lambda p, n: engine_pass(engine, p, n, workload_entries(p, n)),
        "hf_one_by_one": lambda p, n: one_by_one(oracle_model, p, n),
        "hf_padded_all": lambda p, n: padded(fast, p, n, len(p), pad),
        f"hf_padded_{padded_batch}": lambda p, n: padded(fast, p, n, padded_batch, pad),
        "hf_continuous": lambda p, n: continuous(fast, p, n, pad, engine.options.step_tokens),
    }
    compile_s = None
    if compile_blocks:
        compiled = Engine(config, oracle_model, EngineConfig(**engine_args))
        compiled_blocks(compiled.runner.model)
        start = time.perf_counter()
        compiled.generate(prompts, new, stop_at_eos=False)  # every step shape of the workload compiles once
        compile_s = round(time.perf_counter() - start, 1)
        contenders["engine_compiled"] = lambda p, n: engine_pass(compiled, p, n, workload_entries(p, n))
    skipped: dict[str, str] = {}
    for label, run in list(contenders.items()):  # warm-up (first-call allocations); who does not run is said
        try:
            run(prompts[:2], 2)
        except Exception as exc:  # transformers refuses some architectures: the reason is reported
            if label == "engine" or label == "hf_one_by_one":
                raise
            skipped[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            del contenders[label]
    labels = list(contenders)
    passes: dict[str, list[Pass]] = {label: [] for label in labels}
    for r in range(rounds):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            passes[label].append(timed(functools.partial(contenders[label], prompts, new)))
    if any(p.outputs != passes["engine"][0].outputs for p in passes["engine"]):
        raise RuntimeError(f"{name}: the engine's passes disagree")
    tokens = len(prompts) * new
    oracle = passes["hf_one_by_one"][0].outputs
    best = {label: min(ps, key=lambda p: p.cpu_s) for label, ps in passes.items()}
    rows = {label: summarise(ps, best[label], tokens, oracle) for label, ps in passes.items()}
    eng = rows["engine"]
    baselines = {k: v for k, v in rows.items() if k.startswith("hf_")}
    strongest = max(baselines, key=lambda k: baselines[k]["tokens_per_cpu_s"])
    cheapest_padded = min(
        (k for k in baselines if k.startswith("hf_padded")), key=lambda k: baselines[k]["cpu_us_per_computed"]
    )
    vs_best = eng["tokens_per_cpu_s"] / baselines[strongest]["tokens_per_cpu_s"]
    cpu_ratio = eng["cpu_us_per_computed"] / baselines[cheapest_padded]["cpu_us_per_computed"]
    same_mix = {k: _same_mix(best["engine"], best[k]) for k in baselines if k.startswith("hf_padded")}
    same_mix_padded = max(same_mix, key=lambda k: same_mix[k])  # the padded contender whose phases cost the least
    # the plain ratio of an engine paying exactly the cheapest padded pass's price per prefill and per decode token
    at_hf_prices = cpu_ratio / same_mix[cheapest_padded]
    # the same ratios round by round (each round's passes ran back to back): how much the machine moved them
    per_round = [
        (b.cpu_s / e.cpu_s, (e.cpu_s / e.computed) / (p.cpu_s / p.computed))
        for e, b, p in zip(passes["engine"], passes[strongest], passes[cheapest_padded], strict=True)
    ]
    return {
        "model": name,
        "hidden_size": int(config.hidden_size),
        "tokens": tokens,
        "hf_attention": attention,
        "contenders": rows,
        "not_run": skipped,
        "compile_s": compile_s,
        "strongest_baseline": strongest,
        "speedup_vs_strongest": round(vs_best, 2),
        "speedup_rounds": [round(v, 2) for v, _ in per_round],
        "cpu_ratio_rounds": [round(c, 2) for _, c in per_round],
        "wall_speedup_vs_strongest": round(eng["tokens_per_s"] / baselines[strongest]["tokens_per_s"], 2),
        "speedup_vs_one_by_one": round(eng["tokens_per_cpu_s"] / rows["hf_one_by_one"]["tokens_per_cpu_s"], 2),
        "cheapest_padded": cheapest_padded,
        "cpu_per_computed_ratio": round(cpu_ratio, 2),
        "same_mix_padded": same_mix_padded,
        "cpu_same_mix_ratio": round(same_mix[same_mix_padded], 2),
        "plain_ratio_at_hf_prices": round(at_hf_prices, 2),
        "cpu_same_mix_rounds": [
            round(_same_mix(e, p), 2) for e, p in zip(passes["engine"], passes[same_mix_padded], strict=True)
        ],
        "speedup_met": vs_best >= GOAL_VS_BEST,
        "cpu_met": cpu_ratio <= GOAL_CPU_RATIO,
        "cpu_same_mix_met": same_mix[same_mix_padded] <= GOAL_CPU_RATIO,
        "share_met": eng["hybridkv_share"] <= GOAL_SHARE,
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
    rounds: int = 3,
    padded_batch: int = 16,
    max_step_tokens: int | None = None,
    compile_blocks: bool = False,
    max_context: int | None = None,
    device: str = "cpu",
    widen: int = 1,
    dtype: str = "float32",
) -> dict[str, Any]:
    """``device``: where the engine's weights and memory live (``transformers`` runs on the CPU); ``widen``: every
    model's widths times this (``random_models.widened``); ``dtype``: what every contender computes in (the
    engine's weights, activations and K/V; ``transformers``' model), so ``exact`` compares like with like."""
    models = models or tiny_names()
    checkpoints = checkpoints or engine_default(chunk_size, page_size)
    unknown = sorted(set(models) - set(tiny_names()))
    if unknown:
        raise ValueError(f"unknown models {unknown}; choose from {tiny_names()}")
    prompts = bench_prompts(requests, block_tokens, max_new_tokens)
    lengths = [len(p) for p in prompts]
    engine_args = {
        "gpu_memory": gpu_memory,
        "page_size": page_size,
        "chunk_size": chunk_size,
        "prefix_cache": prefix_cache,
        "checkpoints": checkpoints,
        "max_step_tokens": max_step_tokens,
        "max_context": max_context,
        "device": device,
        "dtype": getattr(torch, dtype),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with quiet_transformers():  # its "falling back to the reference implementation" notes: expected here
            rows = [
                bench_model(m, prompts, max_new_tokens, rounds, padded_batch, engine_args, compile_blocks, widen)
                for m in models
            ]
    finally:
        torch.set_num_threads(threads)
    return {
        "requests": requests,
        "prompt_tokens": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
        "max_new_tokens": max_new_tokens,
        "block_tokens": block_tokens,
        "page_size": page_size,
        "chunk_size": chunk_size,
        "max_step_tokens": step_budget(chunk_size, max_step_tokens),
        "prefix_cache": prefix_cache,
        "checkpoints": checkpoints,
        "device": device,
        "rounds": rounds,
        "padded_batch": padded_batch,
        "compile_blocks": compile_blocks,
        "widen": widen,
        "dtype": dtype,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "goals": {"vs_strongest": GOAL_VS_BEST, "cpu_per_computed_ratio": GOAL_CPU_RATIO, "hybridkv_share": GOAL_SHARE},
        "models": rows,
    }
