"""The PD proxy: one OpenAI-compatible endpoint in front of a prefill vLLM and a decode vLLM.

For each ``POST /v1/completions`` or ``/v1/chat/completions``: the request goes to the prefill
server with ``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode":
true}``; the ``kv_transfer_params`` of its answer go, with the original request, to the decode
server, whose answer is the client's (status and body as the decode server gave them; a ``stream``
request's server-sent events are relayed as the decode server sends them, chunk by chunk). ``GET
/health`` answers 200 when both servers do. Standard library only (no vLLM import).

Invariants:
- The decode server always gets the client's request unchanged except for ``kv_transfer_params``
  (the prefill server's, or none when it gave none or failed: then decode computes the prompt
  itself; a prefill failure never fails the request).
- The prefill server is never asked to stream; a streamed request's events come from the decode server
  only, unchanged, and a client that goes away closes the decode stream (vLLM then aborts the request).
- A body that is not one JSON object, has no or a bad ``Content-Length``, or is over ``MAX_BODY_BYTES``
  is refused (400 / 411 / 413) before any server sees it.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("hybridkv.vllm.pd")
ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES = 32 << 20
STREAM_CHUNK = 1 << 16


def post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, bytes]:
    """(HTTP status, body) of a JSON POST; a refused connection is (502, its reason)."""
    answer = open_post(url, body, timeout_s)
    if isinstance(answer, tuple):
        return answer
    with answer as resp:
        return resp.status, resp.read()


def open_post(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    """The open response of a JSON POST answered 200 (the caller reads and closes it), else (status, body);
    a refused connection is (502, its reason)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 502, json.dumps({"error": f"{url}: {exc}"}).encode()


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill server is asked: the prompt, one token, params asking it to hold the blocks."""
    out = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    return out


class PDProxy:
    """The proxy server; ``serve_forever`` in a thread of its own with ``start``."""

    def __init__(self, prefill: str, decode: str, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 600.0):
        for side, url in (("prefill", prefill), ("decode", decode)):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"the {side} server's URL {url!r} is not http://host:port or https://host:port")
        self.prefill, self.decode, self.timeout_s = prefill.rstrip("/"), decode.rstrip("/"), timeout_s
        self.stats = {"requests": 0, "with_params": 0, "prefill_failed": 0}
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                log.debug(format, *args)

            def do_GET(self) -> None:
                if self.path != "/health":
                    return self._answer(404, b'{"error": "not found"}')
                ok = all(_alive(f"{u}/health") for u in (proxy.prefill, proxy.decode))
                self._answer(200 if ok else 503, b"{}")

            def do_POST(self) -> None:
                if self.path not in ROUTES:
                    return self._answer(404, json.dumps({"error": f"the proxy serves {list(ROUTES)}"}).encode())
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit():
                    return self._answer(411, b'{"error": "a request needs its Content-Length"}')
                if int(length) > MAX_BODY_BYTES:
                    return self._answer(413, json.dumps({"error": f"body over {MAX_BODY_BYTES} bytes"}).encode())
                try:
                    body = json.loads(self.rfile.read(int(length)))
                    if not isinstance(body, dict):
                        raise ValueError("not a JSON object")
                except ValueError as exc:
                    return self._answer(400, json.dumps({"error": f"request body: {exc}"}).encode())
                if not body.get("stream"):
                    return self._answer(*proxy.forward(self.path, body))
                answer = open_post(proxy.decode + self.path, proxy.decode_body(self.path, body), proxy.timeout_s)
                if isinstance(answer, tuple):
                    return self._answer(*answer)
                with answer as events:  # closed when the client goes: the decode server aborts the request
                    self.send_response(200)
                    self.send_header("Content-Type", events.headers.get("Content-Type", "text/event-stream"))
                    self.send_header("Cache-Control", "no-cache")
                    self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
                    try:
                        while chunk := events.read1(STREAM_CHUNK):
                            self.wfile.write(chunk)
                            self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        log.info("hybridkv PD proxy: the client left a stream; closing the decode server's")

            def _answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.address = f"http://{host}:{self.server.server_address[1]}"
        self._thread: threading.Thread | None = None

    def forward(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """The decode server's answer to ``body`` with the prefill's params."""
        return post(self.decode + path, self.decode_body(path, body), self.timeout_s)

    def decode_body(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the ``kv_transfer_params`` the prefill server answered (None when it failed)."""
        status, data = post(self.prefill + path, prefill_body(body), self.timeout_s)
        params = None
        if status == 200:
            try:
                params = json.loads(data).get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
        with self._lock:
            self.stats["requests"] += 1
            self.stats["with_params"] += params is not None
            self.stats["prefill_failed"] += status != 200
        if status != 200:
            log.warning("hybridkv PD proxy: prefill answered %d (%s); decode computes the prompt", status, data[:300])
        return {**body, "kv_transfer_params": params}

    def start(self) -> PDProxy:
        self._thread = threading.Thread(target=self.server.serve_forever, name="hybridkv-pd-proxy", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
