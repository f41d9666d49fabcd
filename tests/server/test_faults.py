"""An exception out of the engine (a bug) fails every open request with a reason, never a hang or a
traceback to a client; /health turns 503 and new requests get 503 naming why."""

from __future__ import annotations

import json
from typing import Any, NoReturn

import httpx
import pytest


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server()


def test_an_engine_bug_fails_open_requests_and_the_server_says_so(server: Any) -> None:
    def boom() -> NoReturn:
        raise RuntimeError("injected engine bug")

    body = {"input_ids": [7] * 12, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    chunks, lines = [], []
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            lines += [line] if line else []
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
                if len(chunks) == 1:
                    server.backend.engine.step = boom  # the engine thread's next step raises
    assert lines[-1] == "data: [DONE]"
    end = chunks[-1]["meta_info"]["finish_reason"]
    assert end["type"] == "error" and "injected engine bug" in end["message"]
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and "injected engine bug" in health.json()["reason"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and "Traceback" not in r.text
    assert "restart the server" in r.json()["error"]["message"] and r.headers["retry-after"]
