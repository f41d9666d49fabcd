"""The PD proxy (``integrations/vllm/pd_proxy.py``) against two stand-in servers that record what they get:
prefill is asked for one token with ``do_remote_decode``, decode gets the client's request with the
prefill's ``kv_transfer_params`` and its answer is the client's (streamed: its events, as they come); a
prefill failure leaves decode to compute the prompt (params None); a client leaving a stream closes the
decode server's; bad bodies are refused; ``/health`` needs both servers."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from hybridkv.integrations.vllm.pd_proxy import PDProxy, post

PARAMS = {"do_remote_prefill": True, "remote_request_id": "p-1"}


class Upstream:
    """A stand-in vLLM server: answers ``status`` and ``answer`` to every POST, records the bodies."""

    def __init__(self, answer: dict[str, Any], status: int = 200, events: int = 3, gap_s: float = 0.05) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answer, self.status = answer, status
        self.events, self.gap_s = events, gap_s  # a streamed answer: this many events, this far apart
        self.stream_ended: list[str] = []  # per stream: "done" or "client gone"
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                self._send(200 if self.path == "/health" else 404, b"{}")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                upstream.bodies.append(body)
                if not body.get("stream"):
                    return self._send(upstream.status, json.dumps(upstream.answer).encode())
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for i in range(upstream.events):
                        self.wfile.write(f"data: {json.dumps({'n': i})}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(upstream.gap_s)
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                    upstream.stream_ended.append("done")
                except (BrokenPipeError, ConnectionResetError):
                    upstream.stream_ended.append("client gone")

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Iterator[tuple[Upstream, Upstream]]:
    prefill = Upstream({"choices": [{"token_ids": [5]}], "kv_transfer_params": PARAMS})
    decode = Upstream({"choices": [{"token_ids": [1, 2, 3]}]})
    yield prefill, decode
    prefill.close()
    decode.close()


def test_prefill_holds_decode_loads(servers: tuple[Upstream, Upstream]) -> None:
    prefill, decode = servers
    proxy = PDProxy(prefill.url, decode.url).start()
    try:
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "max_completion_tokens": 8, "temperature": 0}
        status, data = post(proxy.address + "/v1/completions", body, 10)
    finally:
        proxy.close()
    assert status == 200 and json.loads(data) == decode.answer
    (asked,) = prefill.bodies
    assert asked["max_tokens"] == 1 and not asked["stream"] and "max_completion_tokens" not in asked
    assert asked["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert asked["prompt"] == [1, 2, 3]
    assert decode.bodies == [{**body, "kv_transfer_params": PARAMS}]  # the client's request, the prefill's params
    assert proxy.stats == {"requests": 1, "with_params": 1, "prefill_failed": 0}


def test_a_prefill_failure_leaves_the_prompt_to_decode(servers: tuple[Upstream, Upstream]) -> None:
    prefill, decode = servers
    prefill.status = 500
    proxy = PDProxy(prefill.url, decode.url).start()
    try:
        status, data = post(proxy.address + "/v1/chat/completions", {"messages": [], "max_tokens": 4}, 10)
    finally:
        proxy.close()
    assert status == 200 and json.loads(data) == decode.answer
    assert decode.bodies == [{"messages": [], "max_tokens": 4, "kv_transfer_params": None}]
    assert proxy.stats == {"requests": 1, "with_params": 0, "prefill_failed": 1}


def test_refusals_and_health(servers: tuple[Upstream, Upstream]) -> None:
    prefill, decode = servers
    proxy = PDProxy(prefill.url, decode.url).start()
    try:
        assert post(proxy.address + "/v1/embeddings", {"input": "x"}, 10)[0] == 404
        req = urllib.request.Request(proxy.address + "/v1/completions", b"[1, 2", {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(req, timeout=10)
        assert bad.value.code == 400
        assert urllib.request.urlopen(proxy.address + "/health", timeout=10).status == 200
        decode.close()
        with pytest.raises(urllib.error.HTTPError) as down:
            urllib.request.urlopen(proxy.address + "/health", timeout=10)
        assert down.value.code == 503
    finally:
        proxy.close()
    assert prefill.bodies == []  # nothing refused reached a server
    with pytest.raises(ValueError, match="decode server's URL 'localhost:8200' is not http://"):
        PDProxy(prefill.url, "localhost:8200")


def test_a_stream_relays_the_decode_servers_events(servers: tuple[Upstream, Upstream]) -> None:
    prefill, decode = servers
    proxy = PDProxy(prefill.url, decode.url).start()
    try:
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "stream": True, "stream_options": {"a": 1}}
        req = urllib.request.Request(proxy.address + "/v1/completions", json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
            lines = [line for line in resp.read().decode().split("\n") if line]
    finally:
        proxy.close()
    assert lines == ['data: {"n": 0}', 'data: {"n": 1}', 'data: {"n": 2}', "data: [DONE]"]
    (asked,) = prefill.bodies  # prefill is asked for one token, not streamed
    assert asked["stream"] is False and asked["max_tokens"] == 1 and "stream_options" not in asked
    assert decode.bodies == [{**body, "kv_transfer_params": PARAMS}]


def test_a_client_leaving_a_stream_closes_the_decode_stream(servers: tuple[Upstream, Upstream]) -> None:
    prefill, decode = servers
    decode.events, decode.gap_s = 400, 0.01  # 4 s of events unless the stream is closed
    proxy = PDProxy(prefill.url, decode.url).start()
    try:
        host, port = proxy.address.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [1], "stream": True}))
        resp = conn.getresponse()
        assert resp.read1(64).startswith(b"data: ")
        resp.close()
        conn.close()  # the client goes
        deadline = time.monotonic() + 3.0
        while not decode.stream_ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proxy.close()
    assert decode.stream_ended == ["client gone"]


def test_bodies_without_a_good_length_are_refused(servers: tuple[Upstream, Upstream]) -> None:
    prefill, decode = servers
    proxy = PDProxy(prefill.url, decode.url).start()
    host, port = proxy.address.removeprefix("http://").split(":")
    try:
        for length, status in (("", 411), ("-5", 411), ("12x", 411), (str((32 << 20) + 1), 413)):
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.putrequest("POST", "/v1/completions")
            if length:
                conn.putheader("Content-Length", length)
            conn.endheaders()
            assert conn.getresponse().status == status, length
            conn.close()
    finally:
        proxy.close()
    assert prefill.bodies == [] and decode.bodies == []
