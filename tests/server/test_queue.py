"""A full server answers 503 with Retry-After; ``abort_all`` ends every open request and frees its memory."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

LONG = {"sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(max_queued=1, engine={"max_running": 1})  # 2 open requests at most


def test_full_queue_answers_503_then_serves_again(server: Any) -> None:
    ends: list[dict[str, Any]] = []

    def stream(ids: list[int]) -> None:
        with httpx.stream("POST", f"{server.url}/generate", json={"input_ids": ids, **LONG}, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk["meta_info"]["finish_reason"]:
                        ends.append(chunk)

    threads = [threading.Thread(target=stream, args=([5 + i] * 10,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while True:  # both admitted by the backend: one runs, one waits
        m = server.backend.metrics()
        if m["running"] + m["waiting"] == 2:
            break
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = httpx.post(f"{server.url}/generate", json={"input_ids": [9] * 10}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "retry later" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/abort_request", json={"abort_all": True}, timeout=30)
    assert r.status_code == 200 and len(r.json()["aborted"]) == 2
    for t in threads:
        t.join(30)
    assert [e["meta_info"]["finish_reason"]["type"] for e in ends] == ["abort", "abort"]
    m = server.backend.metrics()
    assert m["running"] == m["waiting"] == m["held_pages"] == m["held_slots"] == 0
    ok = httpx.post(f"{server.url}/generate", json={"input_ids": [9] * 10, "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
