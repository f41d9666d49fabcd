"""Streams written by the engine's thread (``SocketWriter``, the default) against streams written by the event loop
(``direct_writes=False``, ``serve --loop-writes``): the same tokens, and the direct ones chunk by chunk as the
engine made them, even for a reader too slow to take them as they come."""

from __future__ import annotations

import itertools
import json
import logging
import socket
import struct
import time
from typing import Any

import h11
import httpx
import pytest

from tests.server.conftest import API_KEY, shared_prefix_prompts
from tests.server.test_endpoints import metric, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = shared_prefix_prompts(4, seed=11)
NEW = 12


@pytest.fixture(scope="module")
def servers(start_server: Any) -> dict[str, Any]:
    return {"direct": start_server(api_key=API_KEY), "loop": start_server(api_key=API_KEY, direct_writes=False)}


def _write_cpu(server: Any) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=30).text
    (line,) = [x for x in text.splitlines() if x.startswith("hybridkv_stream_write_cpu_seconds_total ")]
    return float(line.split()[1])


def _events(server: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=AUTH, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_the_engine_thread_writes_each_token_as_its_own_chunk_and_the_loop_gives_the_same_tokens(
    servers: dict[str, Any],
) -> None:
    sampling = {"max_new_tokens": NEW, "ignore_eos": True, "temperature": 0}
    finals = {}
    for mode, server in servers.items():
        before = _write_cpu(server)
        chunks = _events(server, "/generate", {"input_ids": PROMPTS[0], "sampling_params": sampling, "stream": True})
        finals[mode] = chunks[-1]["output_ids"]
        if mode == "direct":  # one chunk per step, never merged: cumulative lengths 1, 2, ..., NEW
            assert [len(c["output_ids"]) for c in chunks] == list(range(1, NEW + 1))
        openai = {"prompt": PROMPTS[1:3], "max_tokens": NEW, "temperature": 0, "stream": True}
        events = _events(server, "/v1/completions", openai)
        got: dict[int, list[int]] = {0: [], 1: []}
        for e in events:
            for choice in e["choices"]:
                got[choice["index"]] += choice["token_ids"]
                if mode == "direct":  # each token in the step that made it (a prompt's end may follow alone)
                    assert len(choice["token_ids"]) == 1 or choice["finish_reason"] == "length", choice
        finals[mode + "-batch"] = [got[0], got[1]]
        written = _write_cpu(server) - before
        assert written > 0 if mode == "direct" else written == 0, (mode, written)
    assert finals["direct"] == finals["loop"] and len(finals["direct"]) == NEW
    assert finals["direct-batch"] == finals["loop-batch"]


def _slow_stream(url: str, body: bytes) -> list[bytes]:
    """``body`` POSTed to /generate from a socket with a 4 KiB receive buffer that reads nothing for a second; then
    every SSE event of the answer (decoded by h11)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect((host, int(port)))
    conn = h11.Connection(h11.CLIENT)
    head = [("host", host), ("content-type", "application/json"), ("content-length", str(len(body)))]
    head.append(("authorization", f"Bearer {API_KEY}"))
    sock.sendall(conn.send(h11.Request(method="POST", target="/generate", headers=head)) + conn.send(h11.Data(body)))
    sock.sendall(conn.send(h11.EndOfMessage()) or b"")
    time.sleep(1.0)  # the server's writes fill both socket buffers meanwhile
    data = b""
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(1 << 16))
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                data += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return [e for e in data.split(b"\n\n") if e]
    finally:
        sock.close()


def test_a_reader_too_slow_for_the_stream_still_gets_every_chunk_whole_and_in_order(servers: dict[str, Any]) -> None:
    new = 400  # cumulative output_ids: ~350 KB of events, far above what the socket buffers hold
    sampling = {"max_new_tokens": new, "ignore_eos": True, "temperature": 0}
    body = {"input_ids": PROMPTS[3], "sampling_params": sampling, "stream": True}
    events = _slow_stream(servers["direct"].url, json.dumps(body).encode())
    assert events[-1] == b"data: [DONE]"
    seen = [json.loads(e.removeprefix(b"data: "))["output_ids"] for e in events[:-1]]  # every chunk whole
    assert all(a == b[: len(a)] and len(a) < len(b) for a, b in itertools.pairwise(seen))  # in order
    assert len(seen[-1]) == new  # (once the socket is full the loop writes, merging what the reader missed)
    plain = httpx.post(f"{servers['direct'].url}/generate", json={**body, "stream": False}, headers=AUTH, timeout=60)
    assert seen[-1] == plain.json()["output_ids"]


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("mode", ["direct", "loop"])
@pytest.mark.parametrize("reset", [False, True])
def test_a_client_that_pipelined_a_second_request_and_left_frees_the_first_at_once(
    servers: dict[str, Any], mode: str, reset: bool
) -> None:
    """uvicorn tells a disconnect only to the newest request of a connection: the first of two pipelined streams
    must still be aborted (not run to its 400th token), its memory freed, and nothing logged as an error."""
    server = servers[mode]
    before = wait_idle(server)
    host, port = server.url.removeprefix("http://").split(":")
    body = {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    raw = json.dumps(body).encode()
    head = f"POST /generate HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {API_KEY}\r\n"
    request = (head + f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n").encode() + raw
    errors = _Errors()
    logging.getLogger("uvicorn.error").addHandler(errors)
    try:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(request + request)
            got = b""
            while got.count(b"data: {") < 2:  # the first stream runs
                got += sock.recv(1 << 16)
            if reset:  # RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        text = wait_idle(server)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
    aborted = "hybridkv_engine_aborted_requests_total"
    assert metric(text, aborted) == metric(before, aborted) + 1  # the first; the second never started
    assert metric(text, "hybridkv_request_pages") == 0 and metric(text, "hybridkv_request_slots") == 0
    assert errors.messages == []
    server.backend.call(lambda e: (e.mem.verify(), e.cache.check()))
