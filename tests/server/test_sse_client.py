"""The load generator's client (``bench.sse_client``) against a real server: every SSE event, in order, with the
engine's tokens; one connection reused across requests; a refusal raises with the status and the field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from hybridkv.bench.sse_client import ServerError, SseClient
from tests.server.conftest import API_KEY

PROMPT = list(range(3, 30))
NEW = 6


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(api_key=API_KEY)


def _body(**extra: Any) -> bytes:
    sampling = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    return msgspec.json.encode({"input_ids": PROMPT, "sampling_params": sampling, "stream": True, **extra})


def test_streams_every_event_and_reuses_its_connection(server: Any, make_engine: Any) -> None:
    reference = make_engine().generate([PROMPT], NEW, stop_at_eos=False)[0].output_ids

    async def run() -> tuple[list[list[bytes]], int]:
        client = SseClient(server.url, {"Authorization": f"Bearer {API_KEY}"}, timeout_s=60)
        try:
            await client.connect(1)
            (conn,) = client._idle
            runs = []
            for i in range(3):
                got: list[tuple[bytes, float]] = []
                await client.post("/generate", _body(cache_salt=f"c{i}"), lambda e, at, got=got: got.append((e, at)))
                stamps = [at for _, at in got]
                assert stamps == sorted(stamps)
                runs.append([e for e, _ in got])
            assert client._idle == [conn]  # the one connection carried all three
            return runs, len(client._idle)
        finally:
            client.close()

    runs, idle = asyncio.run(run())
    assert idle == 1
    for events in runs:
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert chunks[-1]["output_ids"] == reference  # cumulative, as SGLang streams
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": NEW}
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_a_plain_answer_comes_as_one_event_on_the_same_connection(server: Any, make_engine: Any) -> None:
    reference = make_engine().generate([PROMPT], NEW, stop_at_eos=False)[0].output_ids

    async def run() -> list[bytes]:
        client = SseClient(server.url, {"Authorization": f"Bearer {API_KEY}"}, timeout_s=60)
        try:
            got: list[bytes] = []
            for i in range(2):  # a streamed answer, then a plain one: the connection carries both
                await client.post("/generate", _body(cache_salt=f"p{i}", stream=i == 0), lambda e, _: got.append(e))
            assert len(client._idle) == 1
            return got
        finally:
            client.close()

    *streamed, plain = asyncio.run(run())
    assert streamed[-1] == b"data: [DONE]"
    answer = json.loads(plain)  # the whole JSON body, once
    assert answer["output_ids"] == reference and answer["meta_info"]["finish_reason"]["type"] == "length"


def test_a_refusal_raises_with_status_and_field_and_the_client_goes_on(server: Any) -> None:
    async def run() -> None:
        client = SseClient(server.url, {"Authorization": f"Bearer {API_KEY}"}, timeout_s=60)
        try:
            with pytest.raises(ServerError, match=r"answered 400: .*sampling_params\.top_p"):
                sampling = {"max_new_tokens": NEW, "top_p": 7.0}
                body = msgspec.json.encode({"input_ids": PROMPT, "sampling_params": sampling, "stream": True})
                await client.post("/generate", body, lambda e, at: None)
            events: list[bytes] = []
            await client.post("/generate", _body(), lambda e, at: events.append(e))
            assert events[-1] == b"data: [DONE]"
        finally:
            client.close()
        unauthorized = SseClient(server.url, {}, timeout_s=60)
        try:
            with pytest.raises(ServerError, match=r"answered 401: .*authorization"):
                await unauthorized.post("/generate", _body(), lambda e, at: None)
        finally:
            unauthorized.close()

    asyncio.run(run())


def test_refuses_a_url_it_cannot_reach_plainly() -> None:
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        SseClient("https://127.0.0.1:1", {})
