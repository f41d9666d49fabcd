"""Connection limits before the API key: header size (431), header time (408), open connections (503).

Each client here sends no key: the limits hold before authentication. Each refusal is counted on
``/metrics`` (``hybridkv_http_connections_refused_total{reason}``), and the server keeps serving.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from hybridkv.server.connections import ConnectionLimits
from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LIMITS = ConnectionLimits(max_header_bytes=8 * 1024, header_timeout_s=1.0, max_connections=6)


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(api_key=API_KEY, connection_limits=LIMITS)


def refused(server: Any, reason: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    found = re.search(rf'^hybridkv_http_connections_refused_total\{{reason="{reason}"\}} (\S+)$', text, re.M)
    assert found is not None, text[-2000:]
    return float(found.group(1))


def connect(server: Any) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    return sock


def read_answer(sock: socket.socket) -> bytes:
    """What the server sent before it closed (a reset after its answer keeps what came before)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


def wait_count(server: Any, reason: str, at_least: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while refused(server, reason) < at_least:
        assert time.monotonic() < deadline, f"{reason} was not counted within {timeout_s} s"
        time.sleep(0.05)


def test_an_endless_header_line_is_cut_off_before_the_key(server: Any) -> None:
    before = refused(server, "header_too_large")
    sock = connect(server)
    sent = 0
    line = b"a" * 65536
    answer: list[bytes] = []
    reader = threading.Thread(target=lambda: answer.append(read_answer(sock)), daemon=True)
    reader.start()
    try:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Long: ")
        while sent < 32 << 20:  # 32 MiB of one header line: a server without the limit reads all of it
            sock.sendall(line)
            sent += len(line)
    except (BrokenPipeError, ConnectionResetError):
        pass
    reader.join(10)
    sock.close()
    assert sent < 32 << 20, "the server read a 32 MiB header line"
    assert answer[0] == b"" or answer[0].startswith(b"HTTP/1.1 431 "), answer[0][:200]
    wait_count(server, "header_too_large", before + 1)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_large_headers_under_the_limit_and_a_large_body_pass(server: Any) -> None:
    small = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
    r = httpx.post(f"{server.url}/generate", json=small, headers={**AUTH, "X-Padding": "p" * 6000}, timeout=30)
    assert r.status_code == 200, r.text
    big = {"input_ids": [5, 6, 7] * 2000, "sampling_params": {"max_new_tokens": 1}}  # ~ 18 KiB of body
    r = httpx.post(f"{server.url}/generate", json=big, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]  # read whole, past the gate


def test_slow_or_silent_heads_are_closed_with_408(server: Any) -> None:
    before = refused(server, "header_timeout")
    silent = connect(server)
    dripping = connect(server)
    dripping.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    for i in range(8):  # a header line every 0.25 s: never a complete head
        try:
            dripping.sendall(f"X-Drip-{i}: 1\r\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.25)
    assert read_answer(dripping).startswith(b"HTTP/1.1 408 ")
    assert read_answer(silent).startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - started < 5
    silent.close()
    dripping.close()
    wait_count(server, "header_timeout", before + 2)
    # a complete head in time is served (the limit is on the head, not the request)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_connections_beyond_the_bound_get_503_then_the_server_serves(server: Any) -> None:
    before = refused(server, "too_many_connections")
    held = [connect(server) for _ in range(LIMITS.max_connections)]
    time.sleep(0.1)  # every one accepted
    extra = connect(server)
    answer = read_answer(extra)
    extra.close()
    for sock in held:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
    assert b"retry-after: 1" in answer.lower()
    time.sleep(0.2)  # the held connections are gone
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    wait_count(server, "too_many_connections", before + 1)


def test_limits_refuse_nonsense() -> None:
    for bad in (dict(max_header_bytes=10), dict(header_timeout_s=0.0), dict(max_connections=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ConnectionLimits(**bad)  # type: ignore[arg-type]
