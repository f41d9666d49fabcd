"""``hybridkv bench serve``: load on ``hybridkv serve`` over HTTP next to the engine driven directly, same run.

Workload: the scaled-down Mooncake conversations of ``bench engine`` (``conversation_prompts``:
requests of whole conversations, sharing prefixes), in arrival order, arriving as a Poisson
process at ``request_rate`` per second (seeded; ``inf``: all at once); greedy, exactly
``max_new_tokens`` each (``ignore_eos``).

Two sides per round, rounds alternating, on the same arrival schedule:
- ``engine``: an ``Engine`` in this process with the server's sizing, driven by a loop that
  submits each request at its arrival time and steps while it has work (the cache is cleared
  before each round);
- ``http``: a ``hybridkv serve`` subprocess (started here on 127.0.0.1, or ``url``) driven by the
  asyncio client of ``sse_client`` (one connection per request in flight, all opened before the
  clock starts) that sends each request at its arrival time as a streaming ``POST /generate``
  (each round its own ``cache_salt``, so no round hits another's cache).

With ``disaggregated`` (extra ``hybridkv serve`` options: ``--disaggregated`` and its layout), a third
side per round, ``pd``: a ``hybridkv serve --disaggregated`` subprocess with the same sizing (its budget
per worker process), driven like ``http`` on the same schedule; rounds alternate engine, http, pd. Its
``exact`` counts requests whose tokens equal the engine's; its CPU is not counted (the workers are
processes of their own, outside the server's ``/metrics``).

``overhead``: each of the first ``alone`` requests served alone, once by the engine and right
after by the server (so both run under the same machine load), each in a cache namespace of its
own, streamed (one SSE chunk per token, as the load rounds): HTTP end-to-end minus the engine's, p50 /
p99. On a shared machine that difference swings by several ms from run to run with how fast each
process's engine happens to run (two identical servers measured 7.8 ms apart), so ``overhead_steady``
takes each side's engine CPU for the request out first: (HTTP end-to-end minus the server's engine
thread CPU during the request, less what that thread spent writing streamed chunks: that is serving) minus
(the engine's end-to-end minus its CPU): what serving adds besides computing, waiting for the GIL and for
a core included. The goal (p50 <= 2 ms) is judged on it. With ``compare_writes``, a second server whose
streams take the other write path (``--loop-writes`` or not) serves the same requests, interleaved with the
first's (each goes first every other request): ``other_writes`` holds its figures.
``overhead_plain`` (and its steady form): the same requests again, not streamed (one JSON answer): the
part that does not grow with the tokens (the rest is per streamed chunk). ``endpoints``: the same requests
alone again, each streamed as ``/generate``, as ``/v1/completions`` and as ``/v1/completions`` asking for
log-probabilities (order rotating, tokens checked equal): end-to-end per endpoint and the p50 ratios
``completions_to_generate`` and ``logprobs_to_plain``. The CPU of the streamed phase
is counted too, from the server's ``/metrics`` scraped around each request, less what two scrapes with nothing
between them find (``scrape_cpu_ms``, the median of 5: rendering one scrape and parsing the next land between
the readings; the engine thread's share, taken out of ``computing`` too, would otherwise lower the steady
figure): ``http_cpu_ms``, what the thread serving HTTP (the event loop) used per request;
``stream_write_cpu_ms``, what the server's engine thread used per request to encode and write its chunks
(``serve`` without ``--loop-writes``); ``client_cpu_ms``, what this process's client used per request (on a
machine with fewer free cores than the server's two busy threads plus the client, it lands in the overhead);
``server_other_cpu_ms``, the rest of the server process besides its engine thread (the garbage collector; 10
ms clock ticks); ``engine_thread_cpu_ms``, its engine thread, against ``engine_cpu_ms``, the engine driven
directly (the difference: what sharing the process costs the engine). (Under load the two sides batch
differently, so their latencies are compared per side, not per request.)
``send_after_step_us``: p50 / p99 CPU of one chunk-sized ``send`` to a reader process asleep in ``recv``, each right
after one step of this process's engine serving one request (as a request served alone streams its tokens), measured
in the same run (``socket_wake``): what a streamed chunk costs any server on this machine before it encodes anything;
``send_wake_us``: the same after a copy of 8 MiB instead of a step.

``dtype``: the engine's and every server's (``--dtype``: weights, activations and K/V).

Per side under load: TTFT (arrival -> first token), TPOT ((end - first token) / (tokens - 1)), ITL (gaps
between streamed chunks; the engine side: between a request's steps), end-to-end, each p50 and
p99 in ms; request and output-token throughput (over first arrival -> last end); prefix-cache
hit rate (cached over prompt tokens); and ``exact``: requests whose HTTP tokens equal the
engine's; ``cpu_s``: CPU seconds of the engine loop / of the whole server process, and for the
server ``engine_thread_cpu_s``, its engine thread's.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
import uvloop

from hybridkv.bench.engine import conversation_prompts
from hybridkv.bench.server_cpu import NO_CPU, Cpu, ServerCpu, scrape_share, server_cpu, used_between
from hybridkv.bench.socket_wake import send_wake_us
from hybridkv.bench.sse_client import SseClient
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import build_random, quiet_transformers
from hybridkv.engine.sched.request import SamplingParams

GOAL_OVERHEAD_MS = 2.0
START_TIMEOUT_S = 180.0


@dataclass
class Trace:
    """One request's times (``perf_counter`` seconds) on one side."""

    arrival: float
    chunks: list[float] = field(default_factory=list)  # when tokens arrived (one stamp per chunk / step)
    end: float = 0.0
    tokens: list[int] = field(default_factory=list)
    cached: int = 0


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (seconds from the start) of ``n`` Poisson arrivals at ``rate`` per second."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()


def drive_engine(
    engine: Engine, prompts: list[list[int]], offsets: list[float], max_new: int, cache_salt: str | None = None
) -> list[Trace]:
    """Each prompt submitted at its offset from now, stepped to the end (``cache_salt``: their cache namespace)."""
    params = SamplingParams(max_new, 0.0, ignore_eos=True)
    start = time.perf_counter()
    traces = [Trace(start + o) for o in offsets]
    index: dict[Any, int] = {}
    nxt = 0
    while nxt < len(prompts) or engine.has_work():
        now = time.perf_counter()
        while nxt < len(prompts) and traces[nxt].arrival <= now:
            index[engine.submit(prompts[nxt], params, cache_salt=cache_salt)] = nxt
            nxt += 1
        if not engine.has_work():
            time.sleep(max(0.0, traces[nxt].arrival - time.perf_counter()))
            continue
        got = engine.step()
        now = time.perf_counter()
        for rid, token in got.tokens:
            t = traces[index[rid]]
            t.tokens.append(token)
            t.chunks.append(now)
        for out in got.finished:
            t = traces[index.pop(out.rid)]
            t.end, t.cached = now, out.cached_tokens
            if out.error is not None:
                raise RuntimeError(f"the engine failed request {out.rid}: {out.error}")
    return traces


@dataclass(frozen=True)
class Target:
    url: str
    headers: dict[str, str]


class _Meta(msgspec.Struct):
    finish_reason: Any = None
    cached_tokens: int = 0


class _Chunk(msgspec.Struct):  # the fields of a /generate stream chunk the bench reads (the rest skipped)
    output_ids: list[int]
    meta_info: _Meta


_CHUNK = msgspec.json.Decoder(_Chunk)


async def _one(client: SseClient, body: bytes, trace: Trace) -> None:
    await asyncio.sleep(max(0.0, trace.arrival - time.perf_counter()))

    def on_event(event: bytes, at: float) -> None:
        if not event.startswith(b"data: {"):
            return
        chunk = _CHUNK.decode(event[6:])
        if len(chunk.output_ids) > len(trace.tokens):
            trace.tokens = chunk.output_ids
            trace.chunks.append(at)
        if chunk.meta_info.finish_reason is not None:
            trace.end, trace.cached = at, chunk.meta_info.cached_tokens

    await client.post("/generate", body, on_event)


async def _one_plain(client: SseClient, body: bytes, trace: Trace) -> None:
    """One non-streamed request: its answer is one JSON body."""

    def on_body(answer: bytes, at: float) -> None:
        got = _CHUNK.decode(answer)
        trace.tokens, trace.end, trace.cached = got.output_ids, at, got.meta_info.cached_tokens

    await client.post("/generate", body, on_body)


def _body(prompt: list[int], max_new: int, cache_salt: str, stream: bool = True) -> bytes:
    sampling = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    return msgspec.json.encode(
        {"input_ids": prompt, "sampling_params": sampling, "stream": stream, "cache_salt": cache_salt}
    )


async def _load(
    target: Target, prompts: list[list[int]], offsets: list[float], max_new: int, cache_salt: str
) -> list[Trace]:
    client = SseClient(target.url, target.headers)
    try:
        await client.connect(len(prompts))  # every connection up before the clock starts
        start = time.perf_counter()
        traces = [Trace(start + o) for o in offsets]
        await asyncio.gather(
            *[_one(client, _body(p, max_new, cache_salt), t) for p, t in zip(prompts, traces, strict=True)]
        )
    finally:
        client.close()
    return traces


def drive_http(
    target: Target, prompts: list[list[int]], offsets: list[float], max_new: int, cache_salt: str
) -> list[Trace]:
    """Each prompt streamed at its offset from now, concurrently (``cache_salt``: their cache namespace)."""
    return uvloop.run(_load(target, prompts, offsets, max_new, cache_salt))


@dataclass
class Alone:
    """Requests served alone by both sides: per request, HTTP end-to-end minus the engine's (``overhead``) and
    the same with each side's engine CPU for the request taken out (``steady``), and the CPU of the phase."""

    overhead: list[float] = field(default_factory=list)
    steady: list[float] = field(default_factory=list)
    cpu: Cpu = field(default_factory=Cpu)
    scrape: ServerCpu = NO_CPU


async def _one_by_one(
    engine: Engine, targets: list[Target], prompts: list[list[int]], max_new: int, stream: bool
) -> list[Alone]:
    alones = [Alone(scrape=scrape_share(t)) for t in targets]
    clients = [SseClient(t.url, t.headers) for t in targets]
    send = _one if stream else _one_plain
    try:
        for client in clients:
            await client.connect(1)
        for i, prompt in enumerate(prompts):
            cache_salt = (
                f"alone-{stream}-{i}-{time.time_ns()}"  # a namespace of its own: every side computes it in full
            )
            start = time.thread_time()
            (direct,) = drive_engine(engine, [prompt], [0.0], max_new, cache_salt)
            direct_cpu = time.thread_time() - start
            direct_e2e = direct.end - direct.arrival
            for k in range(len(targets)):
                j = (i + k) % len(targets)  # each server goes first as often as the other
                target, client, alone = targets[j], clients[j], alones[j]
                before = server_cpu(target)  # around each request: the scrapes' own CPU stays out of the figures
                start = time.thread_time()
                http = Trace(time.perf_counter())
                await send(client, _body(prompt, max_new, f"{cache_salt}-{j}", stream), http)
                alone.cpu.client += time.thread_time() - start
                used = used_between(before, server_cpu(target), alone.scrape)
                alone.cpu.engine += direct_cpu
                alone.cpu.add_server(used)
                if http.tokens != direct.tokens:
                    raise RuntimeError(f"request {i}: HTTP tokens of {target.url} differ from the engine's")
                http_e2e = http.end - http.arrival
                alone.overhead.append(http_e2e - direct_e2e)
                computing = used.engine_thread - used.stream_write
                alone.steady.append((http_e2e - computing) - (direct_e2e - direct_cpu))
    finally:
        for client in clients:
            client.close()
    return alones


class _Choice(msgspec.Struct):
    token_ids: list[int]
    finish_reason: Any = None


class _CompletionChunk(msgspec.Struct):  # the fields of a /v1/completions stream chunk the bench reads
    choices: list[_Choice]


_COMPLETION_CHUNK = msgspec.json.Decoder(_CompletionChunk)
ENDPOINTS = ("generate", "completions", "completions_logprobs")
"""What ``compare_endpoints`` serves each prompt as: streamed ``/generate``, streamed ``/v1/completions``, and the
latter asking for each token's log-probability (``logprobs: 1``)."""


async def _one_completion(client: SseClient, body: bytes, trace: Trace) -> None:
    def on_event(event: bytes, at: float) -> None:
        if not event.startswith(b"data: {"):
            return
        for choice in _COMPLETION_CHUNK.decode(event[6:]).choices:
            if choice.token_ids:
                trace.tokens = trace.tokens + choice.token_ids
                trace.chunks.append(at)
            if choice.finish_reason is not None:
                trace.end = at

    await client.post("/v1/completions", body, on_event)


def _completion_body(prompt: list[int], max_new: int, cache_salt: str, logprobs: bool) -> bytes:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_new, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "cache_salt": cache_salt} | ({"logprobs": 1} if logprobs else {})
    return msgspec.json.encode(body)


async def _endpoints(target: Target, prompts: list[list[int]], max_new: int) -> dict[str, list[float]]:
    client = SseClient(target.url, target.headers)
    e2e: dict[str, list[float]] = {name: [] for name in ENDPOINTS}
    try:
        await client.connect(1)
        for i, prompt in enumerate(prompts):
            traces = {}
            for k in range(len(ENDPOINTS)):  # each endpoint goes first as often as the others
                name = ENDPOINTS[(i + k) % len(ENDPOINTS)]
                cache_salt = f"endpoints-{name}-{i}-{time.time_ns()}"  # its own namespace: computed in full
                trace = Trace(time.perf_counter())
                if name == "generate":
                    await _one(client, _body(prompt, max_new, cache_salt), trace)
                else:
                    await _one_completion(
                        client, _completion_body(prompt, max_new, cache_salt, name != "completions"), trace
                    )
                e2e[name].append(trace.end - trace.arrival)
                traces[name] = trace.tokens
            if len({tuple(t) for t in traces.values()}) != 1:
                raise RuntimeError(f"request {i}: the endpoints gave different tokens: {traces}")
    finally:
        client.close()
    return e2e


def compare_endpoints(target: Target, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """Each prompt alone, streamed as ``/generate``, as ``/v1/completions`` and as ``/v1/completions`` with
    ``logprobs: 1`` (order rotating; tokens checked equal): end-to-end p50 / p99 per endpoint and the p50 ratios
    of completions to generate and of completions with log-probabilities to without."""
    e2e = uvloop.run(_endpoints(target, prompts, max_new))
    p50 = {name: statistics.median(v) for name, v in e2e.items()}
    return {
        "e2e_ms": {name: _ms(v) for name, v in e2e.items()},
        "completions_to_generate": round(p50["completions"] / p50["generate"], 3),
        "logprobs_to_plain": round(p50["completions_logprobs"] / p50["completions"], 3),
    }


def one_by_one(
    engine: Engine, targets: list[Target], prompts: list[list[int]], max_new: int, stream: bool = True
) -> list[Alone]:
    """Per request, alone on every side, the engine then each server back to back (same machine load); ``stream``:
    each token as its own SSE chunk (else one JSON answer)."""
    return uvloop.run(_one_by_one(engine, targets, prompts, max_new, stream))


def _ms(values: list[float]) -> dict[str, float | None]:
    """Seconds -> p50 and p99 in ms."""
    return _percentiles(values, 1e3)


def _percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50 and p99 of ``values`` times ``scale``."""
    if not values:
        return {"p50": None, "p99": None}
    a = np.asarray(values) * scale
    return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3)}


def summarize(traces: list[Trace], prompts: list[list[int]]) -> dict[str, Any]:
    ttft = [t.chunks[0] - t.arrival for t in traces]
    tpot = [(t.end - t.chunks[0]) / (len(t.tokens) - 1) for t in traces if len(t.tokens) > 1]
    itl = [b - a for t in traces for a, b in zip(t.chunks, t.chunks[1:], strict=False)]
    e2e = [t.end - t.arrival for t in traces]
    span = max(t.end for t in traces) - min(t.arrival for t in traces)
    return {
        "ttft_ms": _ms(ttft),
        "tpot_ms": _ms(tpot),
        "itl_ms": _ms(itl),
        "e2e_ms": _ms(e2e),
        "requests_per_s": round(len(traces) / span, 2),
        "output_tokens_per_s": round(sum(len(t.tokens) for t in traces) / span, 1),
        "prefix_hit_rate": round(sum(t.cached for t in traces) / sum(map(len, prompts)), 4),
    }


@contextmanager
def served(args: list[str]) -> Iterator[str]:
    """A ``hybridkv serve`` subprocess on 127.0.0.1 (any free port); its URL. SIGTERM and reaped on exit."""
    cmd = [sys.executable, "-m", "hybridkv", "serve", "--host", "127.0.0.1", "--port", "0", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
            line = proc.stdout.readline() if ready else ""  # the listening line, or EOF if it failed
            found = re.search(r"listening on (http://\S+)", line)
            if found is None:
                proc.kill()
                proc.wait(timeout=30)
                err.seek(0)
                why = err.read().strip()[-500:] or f"no listening line within {START_TIMEOUT_S} s"
                raise RuntimeError(f"hybridkv serve did not start: {why}")
            yield found.group(1)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)


def run(
    model: str = "tiny-qwen3-next",
    requests: int = 64,
    max_new_tokens: int = 16,
    request_rate: float = 8.0,
    rounds: int = 2,
    alone: int = 16,
    block_tokens: int = 4,
    gpu_memory: int | str = "256MiB",
    page_size: int = 16,
    chunk_size: int = 64,
    seed: int = 0,
    url: str | None = None,
    api_key: str | None = None,
    disaggregated: list[str] | None = None,
    max_context: int | None = None,
    stream_interval: int = 1,
    loop_writes: bool = False,
    compare_writes: bool = False,
    max_step_tokens: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    prompts = conversation_prompts(requests, block_tokens)
    offsets = arrivals(requests, request_rate, seed)
    options = EngineConfig(
        gpu_memory=gpu_memory,
        page_size=page_size,
        chunk_size=chunk_size,
        max_context=max_context,
        max_step_tokens=max_step_tokens,
        dtype=getattr(torch, dtype),
    )
    with quiet_transformers():
        weights, config = build_random(model)
    engine = Engine(config, weights, options)
    engine.generate(prompts[:2], 2, stop_at_eos=False)  # warm-up: first-call allocations
    args = ["--random", model, "--gpu-memory", str(gpu_memory), "--page-size", str(page_size)]
    args += ["--chunk-size", str(chunk_size), "--max-queued", str(requests)]
    args += [] if max_context is None else ["--max-context", str(max_context)]
    args += [] if max_step_tokens is None else ["--max-step-tokens", str(max_step_tokens)]
    args += ["--stream-interval", str(stream_interval), "--dtype", dtype]
    writes = ["--loop-writes"] if loop_writes else []
    headers = {} if not api_key else {"Authorization": f"Bearer {api_key}"}
    per_round: list[dict[str, Any]] = []
    with ExitStack() as servers:
        target = Target(servers.enter_context(_server(url, [*args, *writes])), headers)
        drive_http(target, prompts[:2], [0.0, 0.0], 2, "warm-up")
        targets = [target]
        if compare_writes:  # the other write path, its requests interleaved with the first server's
            other = ["--loop-writes"] if not loop_writes else []
            targets.append(Target(servers.enter_context(served([*args, *other])), {}))
            drive_http(targets[1], prompts[:2], [0.0, 0.0], 2, "warm-up")
        streamed, *others = one_by_one(engine, targets, prompts[:alone], max_new_tokens)
        plain = one_by_one(engine, [target], prompts[:alone], max_new_tokens, stream=False)[0]
        endpoints = compare_endpoints(target, prompts[:alone], max_new_tokens)
        wake = send_wake_us()
        with _decoding(engine, prompts[0], max_new_tokens) as step:
            after_step = send_wake_us(between=step)
        pd = None  # started after the overhead phase: its idle workers do not load the machine during it
        if disaggregated is not None:
            pd = Target(servers.enter_context(served([*args, *disaggregated])), {})
            drive_http(pd, prompts[:2], [0.0, 0.0], 2, "warm-up")
        for r in range(rounds):
            engine.clear_cache()
            cpu = Cpu()
            start = time.thread_time()
            direct = drive_engine(engine, prompts, offsets, max_new_tokens)
            cpu.engine = time.thread_time() - start
            before = server_cpu(target)
            http = drive_http(target, prompts, offsets, max_new_tokens, f"round-{r}-{time.time_ns()}")
            cpu.add_server(used_between(before, server_cpu(target)))
            per_round.append(
                {
                    "engine": {**summarize(direct, prompts), "cpu_s": round(cpu.engine, 3)},
                    "http": {
                        **summarize(http, prompts),
                        "cpu_s": round(cpu.server.process, 3),
                        "engine_thread_cpu_s": round(cpu.server.engine_thread, 3),
                    },
                    "exact": sum(h.tokens == d.tokens for h, d in zip(http, direct, strict=True)),
                }
            )
            if pd is not None:
                split = drive_http(pd, prompts, offsets, max_new_tokens, f"round-{r}-{time.time_ns()}")
                per_round[-1]["pd"] = {**summarize(split, prompts), "cpu_s": None}
                per_round[-1]["pd_exact"] = sum(p.tokens == d.tokens for p, d in zip(split, direct, strict=True))
    lengths = [len(p) for p in prompts]
    steady = _ms(streamed.steady)
    return {
        "model": model,
        "requests": requests,
        "request_rate": request_rate,
        "rounds": rounds,
        "alone": len(streamed.overhead),
        "max_new_tokens": max_new_tokens,
        "max_step_tokens": engine.options.step_tokens,
        "dtype": dtype,
        "prompt_tokens": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
        "server": url or "hybridkv serve subprocess on 127.0.0.1",
        "disaggregated": None if disaggregated is None else " ".join(disaggregated),
        "per_round": per_round,
        **_alone_figures(streamed),
        "overhead_plain_ms": _ms(plain.overhead),
        "overhead_plain_steady_ms": _ms(plain.steady),
        "endpoints": endpoints,
        "stream_interval": stream_interval,
        "loop_writes": loop_writes,
        "other_writes": None if not others else {"loop_writes": not loop_writes, **_alone_figures(others[0])},
        "send_wake_us": _percentiles(wake),
        "send_after_step_us": _percentiles(after_step),
        "goal_overhead_ms": GOAL_OVERHEAD_MS,
        "goal_met": steady["p50"] is not None and steady["p50"] <= GOAL_OVERHEAD_MS,
    }


@contextmanager
def _decoding(engine: Engine, prompt: list[int], max_new: int) -> Iterator[Callable[[], None]]:
    """A callable that runs one step of ``engine`` serving one request of ``max_new`` tokens (the next submitted, and
    prefilled, when it ends), as a request served alone; the request left is aborted on exit (the engine is idle)."""
    rid: list[int] = []

    def step() -> None:
        if not engine.has_work():
            rid[:] = [
                engine.submit(
                    prompt, SamplingParams(max_new, 0.0, ignore_eos=True), cache_salt=f"probe-{time.time_ns()}"
                )
            ]
        engine.step()

    try:
        yield step
    finally:
        if rid:
            engine.abort(rid[0], "the probe is over")  # a no-op if it just ended


def _alone_figures(alone: Alone) -> dict[str, Any]:
    """One server's streamed requests alone: overhead (as e2e - e2e and steady) and CPU per request, in ms."""
    n, cpu, server = len(alone.overhead), alone.cpu, alone.cpu.server
    return {
        "overhead_ms": _ms(alone.overhead),
        "overhead_steady_ms": _ms(alone.steady),
        "http_cpu_ms": round(1e3 * server.loop / n, 3),
        "stream_write_cpu_ms": round(1e3 * server.stream_write / n, 3),
        "client_cpu_ms": round(1e3 * cpu.client / n, 3),
        "server_other_cpu_ms": round(1e3 * (server.process - server.engine_thread - server.loop) / n, 3),
        "engine_thread_cpu_ms": round(1e3 * server.engine_thread / n, 3),
        "engine_cpu_ms": round(1e3 * cpu.engine / n, 3),
        "scrape_cpu_ms": {
            "loop": round(1e3 * alone.scrape.loop, 3),
            "engine_thread": round(1e3 * alone.scrape.engine_thread, 3),
        },
    }


@contextmanager
def _server(url: str | None, args: list[str]) -> Iterator[str]:
    if url is not None:
        yield url.rstrip("/")
        return
    with served(args) as base:
        yield base
