"""An idle engine gathers the burst that wakes it (``EngineBackend``'s ``gather_gap_s`` / ``gather_max_s``): requests
that reach it one by one, each soon after the last, share its first step; the gathering ends at its most."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from hybridkv.engine.engine import Engine
from hybridkv.engine.sched.request import SamplingParams
from hybridkv.server import EngineBackend
from hybridkv.server.warmup import Ended
from tests.server.conftest import MODEL, SIZING

NEW = 3


class FirstToken(Ended):
    """A sink that also stamps its first token."""

    def __init__(self) -> None:
        super().__init__()
        self.first_at: float | None = None

    def on_token(self, token: int, logprob: object = None) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()


def _submit_spaced(backend: EngineBackend, count: int, every_s: float) -> tuple[list[FirstToken], float]:
    """``count`` requests of their own prompts (nothing cached), one every ``every_s``; their sinks and when the last
    went in."""
    sinks = []
    for i in range(count):
        sink = FirstToken()
        backend.submit([3 + i, 40 + i, 90, 7 + i, 11], SamplingParams(max_new_tokens=NEW, ignore_eos=True), sink)
        sinks.append(sink)
        if i + 1 < count:
            time.sleep(every_s)
    return sinks, time.monotonic()


def test_a_burst_that_wakes_an_idle_engine_shares_its_first_step(make_engine: Callable[..., Engine]) -> None:
    # each request 20 ms after the last, the gap 0.5 s: gathered whole, even on a loaded machine
    backend = EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"], gather_gap_s=0.5, gather_max_s=5.0)
    try:
        steps = backend.metrics()["steps"]
        sinks, _ = _submit_spaced(backend, 6, 0.02)
        for sink in sinks:
            assert sink.done.wait(60) and sink.result is not None and sink.result.error is None
        # one prefill step for all six, then one decode step per further token: had the first step started on the
        # first request alone, the others would have needed steps of their own
        assert backend.metrics()["steps"] - steps == NEW
    finally:
        backend.close(10)


def test_gathering_ends_at_its_most_while_requests_keep_coming(make_engine: Callable[..., Engine]) -> None:
    backend = EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"], gather_gap_s=0.2, gather_max_s=0.3)
    try:
        sinks, last_in = _submit_spaced(backend, 20, 0.05)  # a second of requests, each well within the gap
        for sink in sinks:
            assert sink.done.wait(60) and sink.result is not None and sink.result.error is None
        first = sinks[0].first_at
        assert first is not None and first < last_in  # the first step did not wait for the whole stream
    finally:
        backend.close(10)


def test_without_gathering_the_first_request_steps_at_once(make_engine: Callable[..., Engine]) -> None:
    backend = EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"], gather_gap_s=0.0, gather_max_s=0.0)
    try:
        steps = backend.metrics()["steps"]
        sinks, _ = _submit_spaced(backend, 3, 0.3)  # far apart: the engine is idle again before each
        for sink in sinks:
            assert sink.done.wait(60) and sink.result is not None and sink.result.error is None
        assert backend.metrics()["steps"] - steps == 3 * NEW  # each request its own steps
    finally:
        backend.close(10)


@pytest.mark.parametrize(("gap", "most"), [(-0.001, 0.05), (0.1, 0.05)])
def test_a_bad_gathering_window_is_refused_naming_both(make_engine: Callable[..., Engine], gap: float, most: float):
    with pytest.raises(ValueError, match=rf"gather gap {gap} s and most {most} s: give 0 <= gap <= most"):
        EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"], gather_gap_s=gap, gather_max_s=most)


def test_the_engine_thread_is_not_left_waiting_by_a_close_during_gathering(make_engine: Callable[..., Engine]) -> None:
    backend = EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"], gather_gap_s=5.0, gather_max_s=10.0)
    sink = FirstToken()
    backend.submit([3, 4, 5], SamplingParams(max_new_tokens=NEW), sink)
    started = time.monotonic()
    closer = threading.Thread(target=backend.close, args=(10,))
    closer.start()
    closer.join(15)
    assert not closer.is_alive() and time.monotonic() - started < 5.0  # the close ended the gathering
    assert sink.done.wait(10) and sink.result is not None and sink.result.error == "the server shut down"
