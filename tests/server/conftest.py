"""Fixtures of the HTTP server tests: one tiny random model per session, one server per test module.

``start_server(**opts)`` serves a fresh ``Engine`` over ``EngineBackend`` from a thread on
127.0.0.1 (an ephemeral port) and returns the ``HttpServer``; ``reference`` is ``Engine.generate``
on another engine with the same weights and sizing, the oracle the served tokens must equal.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import build_random
from hybridkv.server import EngineBackend, HttpServer, ServerConfig, bind

MODEL = "tiny-qwen3-next"
SIZING: dict[str, Any] = dict(gpu_memory="64MiB", page_size=16, chunk_size=64)
API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def tiny() -> tuple[Any, Any]:
    return build_random(MODEL)


@pytest.fixture(scope="session")
def make_engine(tiny: tuple[Any, Any]) -> Callable[..., Engine]:
    def make(**opts: Any) -> Engine:
        weights, config = tiny
        return Engine(config, weights, EngineConfig(**{**SIZING, **opts}))

    return make


@pytest.fixture(scope="module")
def start_server(make_engine: Callable[..., Engine]) -> Iterator[Callable[..., HttpServer]]:
    started: list[HttpServer] = []
    engines: list[Engine] = []

    def start(max_queued: int = 64, shutdown_timeout: float = 10.0, engine: Any = None, **config: Any) -> HttpServer:
        engines.append(make_engine(**(engine or {})))
        backend = EngineBackend(engines[-1], MODEL, SIZING["gpu_memory"], max_queued)
        server = HttpServer(backend, ServerConfig(**config), bind("127.0.0.1", 0), shutdown_timeout)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
    for made in engines:  # their store clients too: one left open logs reconnects into later tests' stderr
        made.close()


def shared_prefix_prompts(n: int, groups: int = 4, prefix: int = 48, seed: int = 7) -> list[list[int]]:
    """``n`` prompts in ``groups`` families sharing a ``prefix``-token head, each with its own tail."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(3, 256, prefix).tolist() for _ in range(groups)]
    return [heads[i % groups] + rng.integers(3, 256, int(rng.integers(1, 40))).tolist() for i in range(n)]


def stop_in(text: str) -> str:
    """A stop string ``text`` contains: two characters from the middle of ``text`` that are text (no U+FFFD)."""
    for i in range(len(text) // 3, len(text) - 2):
        if "\ufffd" not in text[i : i + 2]:
            return text[i : i + 2]
    raise AssertionError(f"no stop string to take from {text!r}")


def listening_url(proc: subprocess.Popen[Any], logs: Path, timeout_s: float = 120.0) -> str:
    """The URL a ``hybridkv serve`` subprocess prints once it listens (its stdout in ``logs / "out"``, stderr in
    ``logs / "err"``): fails naming its stderr when it exits first, or when it has not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, (logs / "err").read_text()
        assert time.monotonic() < deadline, "the server did not start"
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", (logs / "out").read_text())
        if found:
            return found.group(1)
        time.sleep(0.1)
