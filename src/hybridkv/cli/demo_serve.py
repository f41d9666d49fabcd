"""The demo's requests through ``hybridkv serve --disaggregated``: a real server process, a real HTTP client.

``serve_requests(model_dir, prompts, ...)`` starts ``hybridkv serve --disaggregated`` on 127.0.0.1
(any free port) with the demo's layout and ``--fault`` options, then streams the prompts as SGLang
``POST /generate`` requests from an httpx client: the first ``alone`` one at a time (each is in the
prefill prefix cache when the next comes), then the next one, and as soon as the server answered
its headers (it is submitted: the server's submission index, which ``--fault`` names, is the
prompt's index) all the others at once, concurrently. Once every request ended it scrapes
``/metrics`` until no request holds pages or slots (bounded), and stops the server (SIGTERM: every
worker reaped, every shm file unlinked).

Invariant: nothing here judges the answers; the demo compares them with ``transformers``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

SETTLE_S = 15.0  # how long /metrics may take to show every page and slot back after the last request


@dataclass
class Served:
    """One request as the client saw it."""

    tokens: list[int] = field(default_factory=list)
    finish: str = ""  # SGLang's finish_reason type: length, stop, abort, error ("": no end came)
    message: str = ""  # why it did not finish
    cached_tokens: int = 0
    ttft_s: float | None = None  # sent -> first token
    e2e_s: float = 0.0  # sent -> its end


@dataclass
class ServedRun:
    requests: list[Served]
    metrics: dict[str, float]  # every /metrics sample after the run, by ``name{labels}``
    wall_s: float  # server start-up included


def server_args(model_dir: str, transport: str, faults: list[str], transfer_timeout_s: float | None) -> list[str]:
    """``hybridkv serve`` options of the demo: PP 2 prefill -> TP 2 decode, pages and prefill chunks of 16."""
    args = ["--disaggregated", "--model", model_dir, "--prefill-pp", "2", "--decode-tp", "2"]
    args += ["--transport", transport, "--page-size", "16", "--chunk-size", "16"]
    args += ["--gpu-memory", "8MiB", "--max-context", "256"]
    for fault in faults:
        args += ["--fault", fault]
    if transfer_timeout_s is not None:
        args += ["--transfer-timeout", str(transfer_timeout_s)]
    return args


def serve_requests(
    model_dir: str,
    prompts: list[list[int]],
    max_new: int,
    alone: int,
    transport: str,
    faults: list[str],
    transfer_timeout_s: float | None = None,
) -> ServedRun:
    """Serve ``prompts`` through a ``hybridkv serve --disaggregated`` process (greedy, ``max_new`` tokens each,
    EOS ignored); see the module docstring for the order."""
    from hybridkv.bench.serve import served

    started = time.monotonic()
    with served(server_args(model_dir, transport, faults, transfer_timeout_s)) as url:
        requests = asyncio.run(_send_all(url, prompts, max_new, alone))
        metrics = _settled_metrics(url)
    return ServedRun(requests, metrics, time.monotonic() - started)


async def _send_all(url: str, prompts: list[list[int]], max_new: int, alone: int) -> list[Served]:
    got = [Served() for _ in prompts]
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(min(alone, len(prompts))):
            await _stream(client, url, prompts[i], max_new, got[i], None)
        if alone >= len(prompts):
            return got
        submitted = asyncio.Event()

        async def after_it(i: int) -> None:
            await submitted.wait()
            await _stream(client, url, prompts[i], max_new, got[i], None)

        await asyncio.gather(
            _stream(client, url, prompts[alone], max_new, got[alone], submitted),
            *[after_it(i) for i in range(alone + 1, len(prompts))],
        )
    return got


async def _stream(
    client: httpx.AsyncClient, url: str, ids: list[int], max_new: int, into: Served, submitted: asyncio.Event | None
) -> None:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    sent = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/generate", json=body) as resp:
            if submitted is not None:
                submitted.set()
            if resp.status_code != 200:
                into.finish, into.message = "error", f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk["output_ids"] and into.ttft_s is None:
                    into.ttft_s = time.perf_counter() - sent
                into.tokens = chunk["output_ids"]
                meta = chunk["meta_info"]
                if meta["finish_reason"] is not None:
                    into.finish = meta["finish_reason"]["type"]
                    into.message = meta["finish_reason"].get("message") or ""
                    into.cached_tokens = meta["cached_tokens"]
    finally:
        into.e2e_s = time.perf_counter() - sent
        if submitted is not None:
            submitted.set()  # never leave the others waiting


def scrape(url: str) -> dict[str, float]:
    """Every sample of ``url``'s ``/metrics``, by ``name{label="value",...}`` (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=60).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _settled_metrics(url: str) -> dict[str, float]:
    """``/metrics`` once no request holds a page or a slot on any worker (or after ``SETTLE_S``: as it is)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        m = scrape(url)
        held = m.get("hybridkv_request_pages", -1), m.get("hybridkv_request_slots", -1)
        if (held == (0, 0) and m.get("hybridkv_num_requests_running") == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)
