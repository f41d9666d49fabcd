"""The PD proxy (``integrations/vllm/pd_proxy.py``) against two stand-in servers that record what they get:
prefill is asked for one token with ``do_remote_decode``, decode gets the client's request with the
prefill's ``kv_transfer_params`` and its answer is the client's; a prefill failure leaves decode to compute
the prompt (params None); streaming and bad bodies are refused; ``/health`` needs both servers."""

from __future__ import annotations

import json
import threading
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

    def __init__(self, answer: dict[str, Any], status: int = 200) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answer, self.status = answer, status
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                self._send(200 if self.path == "/health" else 404, b"{}")

            def do_POST(self) -> None:
                upstream.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self._send(upstream.status, json.dumps(upstream.answer).encode())

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
        assert post(proxy.address + "/v1/completions", {"prompt": [1], "stream": True}, 10)[0] == 400
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
