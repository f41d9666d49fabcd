"""``hybridkv bench serve --peer vllm``: ``hybridkv serve`` against vLLM's CPU build on the same model, same machine.

Both servers load one model directory written here (``save_shared_model``): a tiny random model
(``random_models``) with its widths times ``widen`` and a vocabulary of ``vocab`` ids, saved with
``save_pretrained``, and a word-level tokenizer over those ids (``t0 t1 ...``) that both load. vLLM
runs from its own venv (``scripts/setup_vllm.sh``: ``.venv-vllm`` under the working directory, the
project's CPU torch) as ``python -m vllm.entrypoints.openai.api_server`` with prefix caching on; if
that venv is missing, ``peer_python`` says why and the bench is skipped, nothing started.

Both servers run ``OMP_NUM_THREADS`` torch threads (1 unless set), unpinned (vLLM's
``VLLM_CPU_OMP_THREADS_BIND=nobind``; by default it pins one thread per core), with the same
KV budget (``--gpu-memory``; vLLM's ``VLLM_CPU_KVCACHE_SPACE`` in whole GiB) and page size.

A third server, "vLLM + HybridKVConnector": the same vLLM with ``hybridkv.integrations.vllm.
HybridKVConnector`` (``--kv-transfer-config``; this process's ``hybridkv`` package, alone, on its
``PYTHONPATH``) and ``VLLM_SERVER_DEV_MODE=1`` for ``POST /reset_prefix_cache``: on ``shared``, once
the prefix was sent alone, vLLM's own prefix cache is reset (the connector's host tier is not), so
its hits come from the connector: ``hit_tokens`` counts them with vLLM's own
(``vllm:prefix_cache_hits`` + ``vllm:external_prefix_cache_hits``), ``external_hit_tokens`` the
connector's alone; next to plain vLLM's, whose prefix stays in its own cache. Its ``exact`` compares
with plain vLLM's tokens.

Per round the servers take turns (which goes first rotates), one server up at a time (started,
loaded, stopped: on a machine of few cores an idle server would still take its share), each
driven by the same client (``SseClient``: streaming ``POST /v1/completions`` with token-id prompts,
greedy, ``ignore_eos``, ``return_token_ids``) on the same prompts, fresh each round (seeded by the
round) so no round hits another's cache:
- ``random``: ``requests`` prompts of ``prompt_tokens`` random ids, all sent at once;
- ``shared``: one prefix of ``prompt_tokens`` random ids, sent alone first (not timed), then
  ``requests`` prompts of that prefix plus ``SUFFIX_TOKENS`` ids of their own, all at once;
- ``alone``: ``alone`` prompts of ``prompt_tokens`` random ids, one at a time: the wall time of each.
Per workload: requests and output tokens per second (first send -> last token), TTFT p50, prompt
tokens each server counts as prefix-cache hits (its ``/metrics``, scraped around the workload),
and ``exact``: requests whose tokens equal the other server's. Medians over rounds, and
hybridkv / vLLM ratios of them (above 1: hybridkv better; for times, vLLM's over hybridkv's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

import hybridkv
from hybridkv.bench.serve import Trace, served
from hybridkv.bench.sse_client import ServerError, SseClient
from hybridkv.engine.random_models import SEED, quiet_transformers, random_config

PEER_VENV = ".venv-vllm"
PEER_STAMP = ".vllm-installed"  # written by scripts/setup_vllm.sh once vLLM imports
SUFFIX_TOKENS = 16
MODEL_NAME = "model"  # what both servers serve the shared model as
START_TIMEOUT_S = 900.0  # vLLM on a few busy cores: loading, warming up, compiling
CONNECTOR = "vllm+connector"
"""The server ``vllm`` with HybridKVConnector (its label: "vLLM + HybridKVConnector")."""
SERVERS = ("hybridkv", "vllm", CONNECTOR)
HIT_METRICS = {
    "hybridkv": ("hybridkv_prefix_cache_hit_tokens_total",),
    "vllm": ("vllm:prefix_cache_hits_total",),
    CONNECTOR: ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total"),
}
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
WORKLOADS = ("random", "shared")
RESET_TRIES = 20  # /reset_prefix_cache refuses while blocks are held (a request finishing): retried 0.5 s apart


def peer_python(root: Path) -> tuple[Path | None, str]:
    """The peer venv's python under ``root`` and "", or None and why it cannot be used."""
    venv = root / PEER_VENV
    python = venv / "bin" / "python"
    if not (venv / PEER_STAMP).is_file() or not python.is_file():
        return None, f"no vLLM installed at {venv} (run scripts/setup_vllm.sh from the repository root)"
    return python, ""


def save_shared_model(name: str, widen: int, vocab: int, directory: str) -> None:
    """The tiny random model ``name`` (widths times ``widen``, ``vocab`` ids; seeded, fp32) and a word-level
    tokenizer over its ids saved to ``directory``: what ``hybridkv serve --model`` and vLLM both load."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    config = random_config(name, widen)
    config.vocab_size = vocab
    with quiet_transformers():
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(directory)
        finally:
            hf_logging.enable_progress_bar()
    words = models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")
    tokenizer = Tokenizer(words)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=config.max_position_embeddings)
    wrapped.save_pretrained(directory)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def connector_config(host_bytes: int) -> str:
    """``--kv-transfer-config`` of HybridKVConnector with a host tier of ``host_bytes``."""
    return json.dumps(
        {
            "kv_connector": "HybridKVConnector",
            "kv_connector_module_path": "hybridkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"host_bytes": host_bytes},
        }
    )


@contextmanager
def vllm_served(
    python: Path, model_dir: str, dtype: str, kv_gib: int, page_size: int, context: int, connector: bool = False
) -> Iterator[str]:
    """vLLM's OpenAI server on 127.0.0.1 serving ``model_dir`` with prefix caching, once ``/health`` answers; its
    URL. With ``connector``: HybridKVConnector (a host tier of the KV budget) and the dev endpoints (reset).
    Its process group is sent SIGTERM (then SIGKILL) on exit."""
    port = _free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", dtype, "--enable-prefix-caching", "--block-size", str(page_size)]
    cmd += ["--max-model-len", str(context), "--served-model-name", MODEL_NAME]
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    # the same torch threads as hybridkv serve, unpinned as its are (vLLM's default pins one per core)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "OMP_NUM_THREADS": threads}
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    env.pop("PYTHONPATH", None)  # this project's tree is not vLLM's ...
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryDirectory(prefix="hybridkv-path-") as path:
        if connector:  # ... but its hybridkv package is, alone (a link: none of this venv's other packages)
            os.symlink(Path(hybridkv.__file__).resolve().parent, os.path.join(path, "hybridkv"))
            env["PYTHONPATH"], env["VLLM_SERVER_DEV_MODE"] = path, "1"
            cmd += ["--kv-transfer-config", connector_config(kv_gib << 30)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    text = log.read()
                    why = start_failure(text, page_size) or f"not healthy within {START_TIMEOUT_S} s"
                    raise RuntimeError(f"vLLM did not start (exit {proc.poll()}): {why}")
                try:
                    if _get(url + "/health", 2.0)[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(1.0)
            try:
                yield url
            except ServerError as exc:  # vLLM answers 500 and names the cause only in its log
                log.seek(0)
                causes = [line for line in log.read().splitlines() if "Error" in line][-3:]
                raise RuntimeError(f"vLLM failed a request ({exc}); its log: {' | '.join(causes)}") from None
        finally:
            _stop(proc)


ROOT_CAUSE = re.compile(r"\b(\w+(?:Error|Exception): .+)$")
"""An exception line of a traceback in vLLM's log (after its ``(Worker pid=N) ERROR date [file:line]`` prefix)."""


def start_failure(log: str, page_size: int) -> str:
    """Why vLLM did not start, from its log: the first exception a traceback names (its root cause: every process
    that failed after it repeats it below) and, where vLLM's attention refused ``--page-size``, what to pass instead;
    else the log's last lines."""
    for line in log.splitlines():
        found = ROOT_CAUSE.search(line)
        if found is not None:
            cause = found.group(1).strip()
            if "block size" in cause:
                cause += f" (--page-size {page_size}: give one that vLLM's attention backend takes, named there)"
            return cause
    return log.strip()[-1500:]


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to the process group ``proc`` leads (vLLM's engine core is a child), SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # children left behind by a leader that exited
        os.killpg(proc.pid, signal.SIGKILL)


def metric_sum(text: str, metric: str) -> float:
    """The sum of ``metric`` over its label sets in Prometheus exposition ``text`` (0 if absent)."""
    pattern = re.compile(rf"^{re.escape(metric)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def hit_tokens(url: str, metrics: tuple[str, ...]) -> float:
    """``metrics`` summed over their label sets in the server's ``/metrics``."""
    text = _get(url + "/metrics")[1]
    return sum(metric_sum(text, m) for m in metrics)


def reset_prefix_cache(url: str) -> None:
    """vLLM's own prefix cache emptied (``POST /reset_prefix_cache``; the connector's store stays)."""
    answer: tuple[int, str] = (0, "")
    for _ in range(RESET_TRIES):
        request = urllib.request.Request(url + "/reset_prefix_cache", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10.0) as got:
                answer = (got.status, got.read().decode())
        except urllib.error.HTTPError as exc:
            answer = (exc.code, "")
        if answer[0] == 200 and json.loads(answer[1] or "{}").get("success", True):
            return
        if answer[0] != 200:
            break
        time.sleep(0.5)
    raise RuntimeError(
        f"vLLM at {url} did not reset its prefix cache (POST /reset_prefix_cache answered {answer[0]} {answer[1]!r}); "
        "the bench starts it with VLLM_SERVER_DEV_MODE=1, which serves that endpoint"
    )


def _body(prompt: list[int], max_new: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_new,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
    ).encode()


async def _one(client: SseClient, prompt: list[int], max_new: int, trace: Trace) -> None:
    def on_event(event: bytes, at: float) -> None:
        if not event.startswith(b"data: {"):
            return
        for choice in json.loads(event[6:]).get("choices", []):
            new = choice.get("token_ids") or []
            if new:
                trace.tokens.extend(new)
                trace.chunks.append(at)
        trace.end = at

    await client.post("/v1/completions", _body(prompt, max_new), on_event)


async def _together(url: str, prompts: list[list[int]], max_new: int) -> list[Trace]:
    client = SseClient(url, {})
    try:
        await client.connect(len(prompts))  # every connection up before the clock starts
        start = time.perf_counter()
        traces = [Trace(start) for _ in prompts]
        await asyncio.gather(*[_one(client, p, max_new, t) for p, t in zip(prompts, traces, strict=True)])
    finally:
        client.close()
    return traces


async def _one_at_a_time(url: str, prompts: list[list[int]], max_new: int) -> list[Trace]:
    client = SseClient(url, {})
    traces = []
    try:
        await client.connect(1)
        for prompt in prompts:
            trace = Trace(time.perf_counter())
            await _one(client, prompt, max_new, trace)
            traces.append(trace)
    finally:
        client.close()
    return traces


@dataclass(frozen=True)
class Prompts:
    """One round's prompts, the same for both servers."""

    warmup: list[list[int]]  # sent first to each server (first-request costs), not timed
    random: list[list[int]]
    prefix: list[int]
    shared: list[list[int]]
    alone: list[list[int]]


def round_prompts(seed: int, round_: int, requests: int, prompt_tokens: int, alone: int, vocab: int) -> Prompts:
    rng = np.random.default_rng([seed, round_])

    def ids(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    prefix = ids(prompt_tokens)
    return Prompts(
        warmup=[ids(prompt_tokens) for _ in range(2)],
        random=[ids(prompt_tokens) for _ in range(requests)],
        prefix=prefix,
        shared=[prefix + ids(SUFFIX_TOKENS) for _ in range(requests)],
        alone=[ids(prompt_tokens) for _ in range(alone)],
    )


def _load_figures(traces: list[Trace], hits: float, external: float | None = None) -> dict[str, Any]:
    for i, t in enumerate(traces):
        if not t.chunks:
            raise RuntimeError(f"request {i} got no tokens")
    span = max(t.end for t in traces) - min(t.arrival for t in traces)
    return {
        "requests_per_s": round(len(traces) / span, 3),
        "output_tokens_per_s": round(sum(len(t.tokens) for t in traces) / span, 2),
        "ttft_p50_ms": round(1e3 * float(np.median([t.chunks[0] - t.arrival for t in traces])), 2),
        "hit_tokens": int(hits),
        **({} if external is None else {"external_hit_tokens": int(external)}),
    }


def drive(url: str, server: str, prompts: Prompts, max_new: int) -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
    """One round on one server: its figures per workload and its tokens per workload."""
    metrics = HIT_METRICS[server]
    external = (EXTERNAL_HITS,) if server == CONNECTOR else None
    figures: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    uvloop.run(_together(url, prompts.warmup, 2))
    for workload in WORKLOADS:
        if workload == "shared":
            uvloop.run(_together(url, [prompts.prefix], 1))  # the prefix cached, not timed
            if server == CONNECTOR:
                reset_prefix_cache(url)  # vLLM's own copy gone: the prefix can only come from the connector
        before = hit_tokens(url, metrics), hit_tokens(url, external) if external else 0.0
        traces = uvloop.run(_together(url, getattr(prompts, workload), max_new))
        after = hit_tokens(url, metrics), hit_tokens(url, external) if external else 0.0
        figures[workload] = _load_figures(traces, after[0] - before[0], after[1] - before[1] if external else None)
        tokens[workload] = [t.tokens for t in traces]
    traces = uvloop.run(_one_at_a_time(url, prompts.alone, max_new))
    figures["alone_ms"] = round(1e3 * float(np.median([t.end - t.arrival for t in traces])), 2)
    tokens["alone"] = [t.tokens for t in traces]
    return figures, tokens


@contextmanager
def _server(
    server: str, python: Path, model_dir: str, dtype: str, gpu_memory: int, page_size: int, context: int
) -> Iterator[str]:
    if server in ("vllm", CONNECTOR):
        kv_gib = max(1, -(-gpu_memory // (1 << 30)))
        with vllm_served(python, model_dir, dtype, kv_gib, page_size, context, server == CONNECTOR) as url:
            yield url
        return
    args = ["--model", model_dir, "--tokenizer", model_dir, "--dtype", dtype, "--gpu-memory", str(gpu_memory)]
    args += ["--page-size", str(page_size), "--max-context", str(context), "--max-queued", "4096"]
    with served(args) as url:
        yield url


def _median(values: list[float]) -> float:
    return round(float(np.median(values)), 3)


def run(
    python: Path,
    model: str = "tiny-gemma3",
    widen: int = 8,
    vocab: int = 32000,
    dtype: str = "float32",
    requests: int = 16,
    prompt_tokens: int = 128,
    max_new_tokens: int = 32,
    rounds: int = 3,
    alone: int = 4,
    gpu_memory: int = 1 << 30,
    page_size: int = 16,
    seed: int = 0,
    log: Any = None,
    connector: bool = True,
) -> dict[str, Any]:
    """The comparison (module docstring); ``python``: the peer venv's. ``log(line)``: progress, if given.
    ``connector=False``: without the "vLLM + HybridKVConnector" server (two servers a round, not three)."""
    context = int(random_config(model, widen).max_position_embeddings)
    if prompt_tokens + SUFFIX_TOKENS + max_new_tokens > context:
        raise ValueError(
            f"--prompt-tokens {prompt_tokens} + {SUFFIX_TOKENS} + --max-new-tokens {max_new_tokens} exceeds the "
            f"model's context of {context} tokens"
        )
    servers = SERVERS if connector else tuple(s for s in SERVERS if s != CONNECTOR)
    per_round: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hybridkv-vs-vllm-") as scratch:
        model_dir = os.path.join(scratch, MODEL_NAME)  # hybridkv serve names a model after its directory
        save_shared_model(model, widen, vocab, model_dir)
        for r in range(rounds):
            prompts = round_prompts(seed, r, requests, prompt_tokens, alone, vocab)
            row: dict[str, Any] = {}
            tokens = {}
            for server in servers[r % len(servers) :] + servers[: r % len(servers)]:
                if log is not None:
                    log(f"round {r}: {server}")
                with _server(server, python, model_dir, dtype, gpu_memory, page_size, context) as url:
                    row[server], tokens[server] = drive(url, server, prompts, max_new_tokens)
            for server, key in (("hybridkv", "exact"), (CONNECTOR, "connector_exact")):
                if server in tokens:
                    row[key] = {
                        w: sum(a == b for a, b in zip(tokens[server][w], tokens["vllm"][w], strict=True))
                        for w in (*WORKLOADS, "alone")
                    }
            per_round.append(row)
    medians = {s: _medians([row[s] for row in per_round]) for s in servers}
    return {
        "model": model,
        "widen": widen,
        "vocab": vocab,
        "hidden_size": int(random_config(model, widen).hidden_size),
        "dtype": dtype,
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "suffix_tokens": SUFFIX_TOKENS,
        "max_new_tokens": max_new_tokens,
        "alone": alone,
        "rounds": rounds,
        "gpu_memory": gpu_memory,
        "page_size": page_size,
        "peer": "vllm",
        "servers": list(servers),
        "per_round": per_round,
        "median": medians,
        "ratio": _ratios(medians["hybridkv"], medians["vllm"]),
    }


def _medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {w: {k: _median([r[w][k] for r in rows]) for k in rows[0][w]} for w in WORKLOADS}
    out["alone_ms"] = _median([r["alone_ms"] for r in rows])
    return out


def _ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """hybridkv / vLLM per median, oriented so above 1 means hybridkv is better (times: vLLM's / hybridkv's)."""

    def ratio(a: float, b: float) -> float | None:
        return None if b == 0 else round(a / b, 3)

    out: dict[str, Any] = {}
    for w in WORKLOADS:
        o, p = ours[w], peer[w]
        out[w] = {
            "requests_per_s": ratio(o["requests_per_s"], p["requests_per_s"]),
            "output_tokens_per_s": ratio(o["output_tokens_per_s"], p["output_tokens_per_s"]),
            "ttft_p50": ratio(p["ttft_p50_ms"], o["ttft_p50_ms"]),
        }
    out["alone"] = ratio(peer["alone_ms"], ours["alone_ms"])
    return out
