"""The server's endpoints driven by real clients (the official ``openai`` client, httpx) over 127.0.0.1.

Every generated token is compared with ``Engine.generate`` on the same prompts (greedy), the
engine that is itself proven token-exact against transformers.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from hybridkv.server import ServerConfig
from tests.server.conftest import API_KEY, MODEL, shared_prefix_prompts

MAX_NEW = 8
PROMPTS = shared_prefix_prompts(32)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(api_key=API_KEY)


@pytest.fixture(scope="module")
def reference(make_engine: Any) -> list[list[int]]:
    return [o.output_ids for o in make_engine().generate(PROMPTS, MAX_NEW)]


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def scrape(server: Any) -> str:
    r = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.text


def wait_idle(server: Any, timeout_s: float = 30.0) -> str:
    """/metrics once no request runs or waits (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(server)
        if metric(text, "hybridkv_num_requests_running") == 0 and metric(text, "hybridkv_num_requests_waiting") == 0:
            return text
        assert time.monotonic() < deadline, "the engine still runs requests"
        time.sleep(0.05)


def test_32_concurrent_openai_requests_equal_engine_generate(server: Any, reference: list[list[int]]) -> None:
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def plain(ids: list[int]) -> tuple[list[int], str, Any]:
        out = await client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_NEW, temperature=0)
        choice = out.choices[0]
        return choice.token_ids, choice.finish_reason, out.usage  # type: ignore[attr-defined]

    async def streamed(ids: list[int]) -> tuple[list[int], str, Any]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        tokens: list[int] = []
        reason, usage = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += choice.token_ids  # type: ignore[attr-defined]
                reason = choice.finish_reason or reason
            usage = chunk.usage or usage
        return tokens, reason, usage

    async def run_all() -> list[tuple[list[int], str, Any]]:
        async with client:
            return await asyncio.gather(*[(plain if i % 2 else streamed)(p) for i, p in enumerate(PROMPTS)])

    got = asyncio.run(run_all())
    for i, (tokens, reason, usage) in enumerate(got):
        assert tokens == reference[i], f"request {i} ({'plain' if i % 2 else 'streamed'})"
        assert reason == "length"
        assert usage.prompt_tokens == len(PROMPTS[i]) and usage.completion_tokens == MAX_NEW
    text = wait_idle(server)
    assert metric(text, "hybridkv_request_pages") == 0 and metric(text, "hybridkv_request_slots") == 0


def test_cached_tokens_where_prefixes_repeat(server: Any) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    family = shared_prefix_prompts(2, groups=1, prefix=80, seed=99)
    first = client.completions.create(model=MODEL, prompt=family[0], max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=family[1], max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # a prefix nobody sent before
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 < cached <= 80  # within the shared head
    # SGLang's meta_info reports the same hit; another cache salt shares nothing
    body = {"input_ids": family[1], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    again = httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=60).json()
    assert again["meta_info"]["cached_tokens"] >= cached
    salted = httpx.post(f"{server.url}/generate", json={**body, "cache_salt": "other"}, headers=AUTH, timeout=60)
    assert salted.json()["meta_info"]["cached_tokens"] == 0


def test_generate_batch_and_stream_equal_engine_generate(server: Any, reference: list[list[int]]) -> None:
    body = {"input_ids": PROMPTS[:6], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    answers = r.json()
    assert [a["output_ids"] for a in answers] == reference[:6]
    for ids, a in zip(PROMPTS, answers, strict=False):
        meta = a["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == MAX_NEW
        assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW}
        assert meta["e2e_latency"] > 0 and meta["id"] and meta["cached_tokens"] >= 0
    # a stream: cumulative output_ids per chunk (SGLang's default), the end in the last chunk, then [DONE]
    body = {"input_ids": PROMPTS[7], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=AUTH, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[-1]["output_ids"] == reference[7]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    seen = [c["output_ids"] for c in chunks]
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(seen))  # each a prefix of the next


def test_a_stream_interval_sends_the_first_token_then_every_nth_then_the_end(
    start_server: Any, reference: list[list[int]]
) -> None:
    server = start_server(api_key=API_KEY, stream_interval=4)
    new = 10
    sampling = {"max_new_tokens": new, "ignore_eos": True, "temperature": 0}
    body = {"input_ids": PROMPTS[5], "sampling_params": sampling, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=AUTH, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    seen = [json.loads(line.removeprefix("data: "))["output_ids"] for line in lines[:-1]]
    assert seen[-1][:MAX_NEW] == reference[5] and len(seen[-1]) == new
    lengths = [len(ids) for ids in seen]
    assert lengths[0] == 1 and lengths[-1] == new  # the first token at once, the end with the last chunk
    assert set(lengths) <= {1, 4, 8, new}, lengths  # between them, a chunk per 4 tokens (a slow reader may merge)
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)  # the OpenAI stream batches alike
    chunks = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=new, stream=True)
    counts = [len(c.choices[0].token_ids) for c in chunks if c.choices]  # type: ignore[attr-defined]
    assert sum(counts) == new and counts[0] == 1 and set(counts[1:-1]) <= {3, 4}, counts
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        ServerConfig(stream_interval=0)


def test_disconnect_mid_stream_frees_the_request(server: Any) -> None:
    before = wait_idle(server)
    aborted = metric(before, "hybridkv_engine_aborted_requests_total")
    body = {"input_ids": PROMPTS[3], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=AUTH, timeout=60) as resp:
        got = 0
        for line in resp.iter_lines():
            got += line.startswith("data: {")
            if got == 2:
                break  # leaving the block closes the connection mid-stream
    text = wait_idle(server)
    assert metric(text, "hybridkv_engine_aborted_requests_total") == aborted + 1  # aborted, not finished
    assert metric(text, "hybridkv_request_pages") == 0 and metric(text, "hybridkv_request_slots") == 0
    # the engine's own books: every page and slot accounted for, the cache consistent
    server.backend.call(lambda e: (e.mem.verify(), e.cache.check()))


def test_abort_request_by_id(server: Any) -> None:
    body = {
        "input_ids": PROMPTS[5],
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        "stream": True,
        "rid": "abort-me",
    }
    last: dict[str, Any] = {}
    sent = False
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=AUTH, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            last = json.loads(line.removeprefix("data: "))
            if not sent:  # the request runs: abort it by its id from another connection
                r = httpx.post(f"{server.url}/abort_request", json={"rid": "abort-me"}, headers=AUTH, timeout=10)
                assert r.status_code == 200 and r.json() == {"aborted": ["abort-me"]}
                sent = True
            if last["meta_info"]["finish_reason"]:
                break
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 400
    text = wait_idle(server)
    assert metric(text, "hybridkv_request_pages") == 0 and metric(text, "hybridkv_request_slots") == 0
    r = httpx.post(f"{server.url}/abort_request", json={"rid": "abort-me"}, headers=AUTH, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "rid"


def test_metrics_models_and_health(server: Any) -> None:
    for _ in range(2):  # of its own (it passes alone): one request ends, and its twin hits the cache
        body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}, "cache_salt": "metrics-test"}
        assert httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=60).status_code == 200
    text = scrape(server)
    for name in (
        "hybridkv_num_requests_running",
        "hybridkv_num_requests_waiting",
        'hybridkv_pool_cells{pool="full",state="live"}',
        'hybridkv_pool_cells{pool="state",state="live"}',
        "hybridkv_request_pages",
        "hybridkv_request_slots",
        'hybridkv_prefix_cache_component_hit_tokens_total{component="full"}',
        'hybridkv_prefix_cache_component_hit_tokens_total{component="checkpoint"}',
        "hybridkv_evicted_pages_total",
        "hybridkv_retractions_total",
        "hybridkv_prefix_waits_total",
        "hybridkv_time_to_first_token_seconds_count",
        "hybridkv_time_per_output_token_seconds_count",
        "hybridkv_e2e_request_latency_seconds_count",
    ):
        assert name in text, name
    assert metric(text, "hybridkv_e2e_request_latency_seconds_count") > 0
    assert metric(text, "hybridkv_prefix_cache_hit_tokens_total") > 0  # the shared prefixes hit
    # the HTTP loop thread's own CPU clock: positive, and below the whole process's
    loop_cpu = metric(text, "hybridkv_http_loop_cpu_seconds_total")
    assert 0 < loop_cpu <= metric(text, "process_cpu_seconds_total") + 0.01
    models = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0).models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(f"{server.url}/health", timeout=10)  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_a_client_that_gives_up_on_a_plain_request_frees_it(server: Any) -> None:
    aborted = metric(wait_idle(server), "hybridkv_engine_aborted_requests_total")
    # 64 choices of 400 tokens: about 2 s here (one choice alone, ~0.4 s, could end before the client gave up)
    body = {"prompt": PROMPTS[9], "max_tokens": 400, "ignore_eos": True, "n": 64}
    with pytest.raises(httpx.ReadTimeout):  # the client closes its connection after 0.5 s without an answer
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=0.5)
    text = wait_idle(server)
    assert metric(text, "hybridkv_engine_aborted_requests_total") == aborted + 64  # every choice, aborted
    assert metric(text, "hybridkv_request_pages") == 0 and metric(text, "hybridkv_request_slots") == 0
