"""``hybridkv serve --disaggregated``'s backend: one PD server (prefill PP 2 -> decode TP 2 processes over shm)
behind the HTTP server, shared by every test of this module, driven by real clients.

Checked: 32 concurrent requests with shared prefixes (the official ``openai`` client, streaming and
not, and httpx) give ``Engine.generate``'s tokens on the same weights, and the ones whose prefix was
served before hit the prefill prefix cache; a client that leaves mid-stream, or an abort by id, frees
the request on both engines (every worker's ``probe``: back to what it held before, no request), and so does a
stop string, the answer cut before it (streamed and not);
bad input is a 4xx naming the field; ``/metrics`` exports the PD figures; a lost engine turns
``/health`` to 503 naming it (the last test: it breaks the shared server).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.disagg import PD_ENGINE, PDConfig, PDServer, WorkerState
from hybridkv.engine.engine import Engine
from hybridkv.engine.parallel.cpu_share import worker_threads
from hybridkv.engine.random_models import save_random
from hybridkv.engine.sched.request import FinishReason, Outcome, SamplingParams
from hybridkv.server import ByteTokenizer, HttpServer, PDBackend, QueueFull, ServerConfig, bind
from tests.server.conftest import API_KEY, MODEL, shared_prefix_prompts, stop_in
from tests.server.test_endpoints import metric

MAX_NEW = 8
PROMPTS = shared_prefix_prompts(32)  # 4 families: PROMPTS[0..3] are the first of each
HEADS = 4
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SIZING: dict[str, Any] = dict(page_size=16, chunk_size=16, gpu_memory=32 << 20, max_context=256)
TIERS: dict[str, Any] = dict(host_memory=16 << 20, tier_policy="through")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pd-model")
    save_random(MODEL, str(path))
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[HttpServer]:
    # restarts=0: a worker death loses its engine at once (the last test); none happens before it
    # host memory below each prefill rank, written through: /metrics carries the ranks' tier counters
    pd = PDServer(
        PDConfig(
            str(model_dir),
            prefill_pp=2,
            decode_tp=2,
            transport="shm",
            restarts=0,
            engine=replace(PD_ENGINE, **SIZING, **TIERS),
        )
    )
    http = HttpServer(
        PDBackend(pd, MODEL, "32MiB", max_queued=64),
        ServerConfig(api_key=API_KEY, tokenizer=ByteTokenizer(256)),
        bind("127.0.0.1", 0),
        10,
    )
    http.start()
    yield http
    http.stop()
    assert pd.shm_paths() and not any(Path(p).exists() for p in pd.shm_paths())


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[Outcome]:
    engine = Engine(model_dir, config=EngineConfig(gpu_memory="64MiB", page_size=16, chunk_size=16, max_context=256))
    return engine.generate(PROMPTS, MAX_NEW)


def pd_of(server: HttpServer) -> PDServer:
    backend = server.backend
    assert isinstance(backend, PDBackend)
    return backend.server


def settled(server: HttpServer, wait_s: float = 30.0) -> list[WorkerState]:
    """Every worker's probe once each holds what it held before its first request and no request (bounded:
    a given-up transfer's pages come back once its writers are proven gone)."""
    end = time.monotonic() + wait_s
    while True:
        states = pd_of(server).probe(timeout_s=30)
        if all(w.live == w.live_before and w.requests == 0 for w in states) or time.monotonic() > end:
            return states
        time.sleep(0.1)


def assert_nothing_held(server: HttpServer) -> None:
    states = settled(server)
    assert len(states) == 4  # 2 prefill stages, 2 decode ranks
    for w in states:
        assert w.live == w.live_before and w.requests == 0, w


async def _stream_openai(client: AsyncOpenAI, ids: list[int]) -> tuple[list[int], str, int]:
    stream = await client.completions.create(
        model=MODEL, prompt=ids, max_tokens=MAX_NEW, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    tokens: list[int] = []
    reason, cached = "", -1
    async for chunk in stream:
        for choice in chunk.choices:
            tokens += choice.token_ids  # type: ignore[attr-defined]
            reason = choice.finish_reason or reason
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return tokens, reason, cached


async def _plain_openai(client: AsyncOpenAI, ids: list[int]) -> tuple[list[int], str, int]:
    out = await client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_NEW, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens == len(ids)
    choice = out.choices[0]
    return choice.token_ids, choice.finish_reason, out.usage.prompt_tokens_details.cached_tokens or 0  # type: ignore[attr-defined]


async def _stream_httpx(client: httpx.AsyncClient, url: str, ids: list[int]) -> tuple[list[int], str, int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, "stream": True}
    last: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/generate", json=body, headers=AUTH) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                last = json.loads(line.removeprefix("data: "))
    meta = last["meta_info"]
    path = meta["disaggregated"]  # a PD request's path: one attempt, its KV moved, each phase timed
    assert path["attempts"] == 1 and path["transfer_bytes"] > 0, path
    assert set(path["timing"]) == {"queue_s", "prefill_s", "transfer_s", "decode_s"}
    assert all(v >= 0 for v in path["timing"].values()), path
    kind = meta["finish_reason"]["type"]
    return last["output_ids"], ("length" if kind == "length" else kind), meta["cached_tokens"]


def test_32_concurrent_requests_equal_engine_generate_and_repeated_prefixes_hit(
    server: HttpServer, reference: list[Outcome]
) -> None:
    async def run_all() -> list[tuple[list[int], str, int]]:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        async with client, httpx.AsyncClient(timeout=300) as plain:
            # the first of each family first (prompts prefilled together do not hit each other), then the rest
            heads = await asyncio.gather(*[_stream_httpx(plain, server.url, p) for p in PROMPTS[:HEADS]])
            kinds = [_stream_openai, _plain_openai]
            rest = await asyncio.gather(
                *[
                    _stream_httpx(plain, server.url, p) if i % 3 == 2 else kinds[i % 3](client, p)
                    for i, p in enumerate(PROMPTS[HEADS:])
                ]
            )
            return heads + rest

    got = asyncio.run(run_all())
    for i, ((tokens, reason, cached), ref) in enumerate(zip(got, reference, strict=True)):
        assert tokens == ref.output_ids, f"request {i}"
        assert reason == ("stop" if ref.finish_reason == "eos" else ref.finish_reason), f"request {i}"
        if i < HEADS:
            assert cached == 0, f"request {i}: a prefix nobody sent before"
        else:  # its family's 48-token head was computed before it came
            assert 16 <= cached <= 48, f"request {i}: cached {cached}"
    assert_nothing_held(server)


def test_meta_info_says_which_tier_the_cached_tokens_came_from(server: HttpServer) -> None:
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=60)
    meta = r.json()["meta_info"]
    assert meta["cached_tokens"] >= 16  # served before: the prefill ranks' devices still hold it
    assert meta["cached_tokens_details"] == {"device": meta["cached_tokens"], "host": 0, "storage": 0}


def test_disconnect_mid_stream_frees_both_engines(server: HttpServer) -> None:
    aborted = metric(scrape(server), "hybridkv_engine_aborted_requests_total")
    body = {"input_ids": PROMPTS[5], "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}, "stream": True}
    got = 0
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=AUTH, timeout=120) as resp:
        for line in resp.iter_lines():
            got += line.startswith("data: {")
            if got == 3:
                held = pd_of(server).probe(timeout_s=30)  # it decodes: the decode ranks hold it
                break  # leaving the block closes the connection mid-stream
    assert sum(w.requests for w in held if w.name.startswith("decode")) == 2
    assert_nothing_held(server)
    text = scrape(server)
    assert metric(text, "hybridkv_engine_aborted_requests_total") == aborted + 1
    assert metric(text, "hybridkv_request_pages") == 0 and metric(text, "hybridkv_request_slots") == 0


def test_abort_request_by_id_frees_both_engines(server: HttpServer) -> None:
    body = {
        "input_ids": PROMPTS[6],
        "sampling_params": {"max_new_tokens": 150, "ignore_eos": True},
        "stream": True,
        "rid": "abort-me",
    }
    last: dict[str, Any] = {}
    sent = False
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=AUTH, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            last = json.loads(line.removeprefix("data: "))
            if not sent:  # it runs: abort it by its id from another connection
                r = httpx.post(f"{server.url}/abort_request", json={"rid": "abort-me"}, headers=AUTH, timeout=30)
                assert r.status_code == 200 and r.json() == {"aborted": ["abort-me"]}
                sent = True
    end = last["meta_info"]["finish_reason"]
    assert end["type"] == "abort" and "aborted by /abort_request" in end["message"]
    assert len(last["output_ids"]) < 150
    assert_nothing_held(server)


def test_a_stop_string_ends_the_request_on_both_engines_streamed_and_not(server: HttpServer) -> None:
    aborted = metric(scrape(server), "hybridkv_engine_aborted_requests_total")
    sampling = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(
        f"{server.url}/generate", json={"input_ids": PROMPTS[7], "sampling_params": sampling}, headers=AUTH, timeout=120
    ).json()
    stop = stop_in(whole["text"])
    want = whole["text"][: whole["text"].index(stop)]
    body = {"input_ids": PROMPTS[7], "sampling_params": {**sampling, "max_new_tokens": 150, "stop": stop}}
    got = httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=120).json()
    assert got["text"] == want and got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert got["output_ids"] == whole["output_ids"][: len(got["output_ids"])] and len(got["output_ids"]) < 40
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, headers=AUTH, timeout=120) as r:
        chunks = [json.loads(x.removeprefix("data: ")) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks[-1]["text"] == want and chunks[-1]["meta_info"]["finish_reason"]["matched"] == stop
    assert_nothing_held(server)
    assert metric(scrape(server), "hybridkv_engine_aborted_requests_total") == aborted + 2


class Collect:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.end: Outcome | None = None
        self.ended = threading.Event()

    def on_token(self, token: int) -> None:
        self.tokens.append(token)

    def on_finish(self, result: Outcome) -> None:
        assert self.end is None, "a second end"
        self.end = result
        self.ended.set()


def test_a_full_backend_refuses_with_queue_full_and_aborting_everything_frees_both_engines(
    server: HttpServer,
) -> None:
    pd = pd_of(server)
    backend = PDBackend(pd, MODEL, "32MiB", max_queued=0)  # a second front on the same PD server: 64 open at most
    assert backend.capacity == pd.config.engine.max_running == 64
    params = SamplingParams(150, ignore_eos=True)
    sinks = [Collect() for _ in range(backend.capacity)]
    tickets = [backend.submit(PROMPTS[i % len(PROMPTS)], params, sink) for i, sink in enumerate(sinks)]
    with pytest.raises(QueueFull, match="retry later"):
        backend.submit(PROMPTS[0], params, Collect())
    for ticket in tickets:
        backend.abort(ticket, "test")
    for sink in sinks:
        assert sink.ended.wait(60)
        assert sink.end is not None and sink.end.finish_reason is FinishReason.ABORT and len(sink.tokens) < 150
    assert backend.metrics()["aborted"] == 64
    assert_nothing_held(server)
    sink = Collect()  # room again
    backend.submit(PROMPTS[0], SamplingParams(2), sink)
    assert sink.ended.wait(60) and sink.end is not None and sink.end.finish_reason is FinishReason.LENGTH


def scrape(server: HttpServer) -> str:
    r = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"input_ids": [1, 2, 999_999], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
        ("/v1/completions", {"prompt": [[1, 2], [3, "x"]], "max_tokens": 2}, "prompt[1][1]"),
        ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 254}, "max_tokens"),  # 257 > the context of 256
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": "high"}}, "sampling_params.top_p"),
        # log-probabilities are served in one process only (PD refuses them, naming the field)
        ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 1}, "logprobs"),
        ("/generate", {"input_ids": [1, 2], "return_logprob": True}, "top_logprobs_num"),
    ],
)
def test_bad_input_is_400_naming_the_field(server: HttpServer, path: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


def test_a_missing_key_is_401_and_the_server_keeps_serving(server: HttpServer) -> None:
    r = httpx.post(f"{server.url}/generate", json={"input_ids": [1, 2]}, timeout=30)
    assert r.status_code == 401
    ok = httpx.post(
        f"{server.url}/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}, headers=AUTH
    )
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def test_metrics_export_the_pd_figures(server: HttpServer) -> None:
    text = scrape(server)
    assert metric(text, "hybridkv_pd_probe_ok") == 1
    assert metric(text, "hybridkv_transfer_bytes_total") > 0 and metric(text, "hybridkv_transfer_failures_total") == 0
    assert metric(text, "hybridkv_prefix_cache_hit_tokens_total") >= 16 * (len(PROMPTS) - HEADS)
    assert metric(text, "hybridkv_pd_worker_deaths_total") == 0
    assert metric(text, "hybridkv_pd_quarantined_requests_total") == 0
    assert metric(text, "hybridkv_pd_mooncake_log_lines_total") == 0  # shm transport: no Mooncake
    assert metric(text, 'hybridkv_pd_engine_restarts_total{engine="decode"}') == 0
    # each prefill rank wrote what it cached through to its host memory; nothing restored, nothing missed
    assert metric(text, 'hybridkv_tier_written_bytes_total{tier="host"}') > 0
    assert metric(text, "hybridkv_tier_fallbacks_total") == 0 and "hybridkv_tier_store_up" not in text
    assert "hybridkv_tier_restored_tokens" not in text  # the router sums counters only
    for phase in ("queued", "prefilling", "transferring", "decoding"):
        assert metric(text, f'hybridkv_pd_requests{{phase="{phase}"}}') == 0
    for w in ("prefill stage 0 TP rank 0", "prefill stage 1 TP rank 0", "decode TP rank 0", "decode TP rank 1"):
        live = metric(text, f'hybridkv_pd_worker_pages{{epoch="0",state="live",worker="{w}"}}')
        assert live == metric(text, f'hybridkv_pd_worker_pages{{epoch="0",state="before",worker="{w}"}}')
        assert metric(text, f'hybridkv_pd_worker_requests{{epoch="0",worker="{w}"}}') == 0
        assert metric(text, f'hybridkv_pd_worker_threads{{epoch="0",worker="{w}"}}') == worker_threads(4)
    # the router's own count: every request of this module so far ended, none failed but the aborted ones (a
    # disconnect, an abort by id, 2 ended by a stop string, the 64 of the full backend)
    m = pd_of(server).metrics()
    assert m["phases"]["finished"] == m["finished"] == m["requests"] - 4 - 64 and m["failed"] == 4 + 64


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected router bug
def test_flush_cache_empties_every_prefill_rank_and_is_refused_while_a_request_runs(server: HttpServer) -> None:
    family = shared_prefix_prompts(2, groups=1, prefix=64, seed=271)  # a head no other test sends

    def cached(ids: list[int]) -> int:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
        r = httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return int(r.json()["meta_info"]["cached_tokens"])

    assert cached(family[0]) == 0 and cached(family[1]) >= 16
    body = {"input_ids": family[0], "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=AUTH, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):  # it runs: a flush changes nothing
                refused = httpx.post(f"{server.url}/flush_cache", headers=AUTH, timeout=30)
                break
    assert refused.status_code == 400 and "1 requests are open" in refused.json()["error"]["message"]
    assert_nothing_held(server)
    flushed = httpx.post(f"{server.url}/flush_cache?host=true", headers=AUTH, timeout=30)  # host memory too
    assert flushed.status_code == 200, flushed.text
    assert cached(family[1]) == 0  # every prefill rank's cache (and host memory) emptied before it came
    assert_nothing_held(server)
    info = httpx.get(f"{server.url}/server_info", headers=AUTH, timeout=30).json()
    assert info["disaggregation_mode"] == "internal" and (info["prefill_pp"], info["decode_tp"]) == (2, 2)


def test_a_lost_engine_or_a_dead_router_turns_health_503(server: HttpServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # the last test: it breaks the shared server (restarts=0: one death loses the engine)
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    pd = pd_of(server)
    assert pd.decode is not None
    os.kill(pd.decode.procs.pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (health := httpx.get(f"{server.url}/health", timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "the death was not noticed"
        time.sleep(0.1)
    reason = health.json()["reason"]
    assert health.status_code == 503 and "the decode engine is lost" in reason and "SIGKILL" in reason
    r = httpx.post(f"{server.url}/generate", json={"input_ids": [1, 2]}, headers=AUTH, timeout=30)
    assert r.status_code == 503 and "decode engine is lost" in r.json()["error"]["message"]
    assert metric(scrape(server), "hybridkv_pd_worker_deaths_total") == 1

    def boom() -> None:
        raise RuntimeError("injected router bug")

    monkeypatch.setattr(pd, "_take_inbox", boom)
    pd.abort(0, "wake the router")
    deadline = time.monotonic() + 30
    while "PD router failed" not in (reason := httpx.get(f"{server.url}/health", timeout=30).json()["reason"]):
        assert time.monotonic() < deadline, reason
        time.sleep(0.1)
    assert "injected router bug" in reason
