"""The warm-up a server runs before it listens: every request ends, memory comes back, no client hits its cache."""

from __future__ import annotations

import random
from collections.abc import Callable

from hybridkv.engine.engine import Engine
from hybridkv.engine.forward.pool_io import pool_layouts
from hybridkv.engine.sched.request import SamplingParams
from hybridkv.server import EngineBackend
from hybridkv.server.warmup import NEW_TOKENS, SCHEDULE, Ended, prompt_lengths, warm_up
from tests.server.conftest import MODEL, SIZING


def test_the_schedule_fits_one_request_and_covers_one_and_two_chunks() -> None:
    assert prompt_lengths(64, 4096) == sorted({*SCHEDULE, 64, 65, 129})
    assert prompt_lengths(64, 40) == [n for n in SCHEDULE if n + NEW_TOKENS <= 40]  # one request fits max_context
    assert prompt_lengths(16, 40) == sorted({n for n in (*SCHEDULE, 16, 17, 33) if n + NEW_TOKENS <= 40})


def test_the_schedule_fills_a_whole_step_with_prompts_of_the_longest_length() -> None:
    schedule = prompt_lengths(64, 512)
    assert prompt_lengths(64, 512, sum(schedule)) == schedule  # the schedule already fills it: nothing added
    lengths = prompt_lengths(64, 512, 2048)
    room = 512 - NEW_TOKENS
    assert lengths[: len(schedule)] == schedule
    added = lengths[len(schedule) :]
    assert added == [room] * len(added) and len(added) >= 1
    assert sum(lengths) >= 2048 > sum(lengths) - room  # the step budget reached, by no more prompts than it takes


def test_warm_up_ends_every_request_and_gives_its_memory_back_to_the_cache(make_engine: Callable[..., Engine]) -> None:
    backend = EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"])
    try:
        report = warm_up(backend, seed=3)
        lengths = prompt_lengths(SIZING["chunk_size"], backend.info.max_context, backend.engine.options.step_tokens)
        assert (report.requests, report.prompt_tokens, report.timed_out) == (len(lengths), sum(lengths), False)
        # the step buffers grown to their bound and kept: what the budget gives them, to the element
        layouts = pool_layouts(backend.engine.mem).tokens.values()
        bounds = [
            layout.workspace_bytes // layout.grid.element_size() * layout.grid.element_size() for layout in layouts
        ]
        assert report.reserved_bytes == sum(bounds) > 0
        buffers = [layout._workspace[0] for layout in layouts]
        assert [b.numel() * b.element_size() for b in buffers] == bounds
        m = backend.metrics()
        assert m["requests"] == len(lengths) and m["prompt_tokens"] == sum(lengths)
        assert (m["running"], m["waiting"], m["held_pages"], m["held_slots"]) == (0, 0, 0, 0)
        # the same prompts from a client (no salt, as the warm-up's is its own): not one cached token
        rng = random.Random(3)
        prompts = [[rng.randrange(backend.info.vocab_size) for _ in range(n)] for n in lengths]
        sinks = [Ended() for _ in prompts]
        for prompt, sink in zip(prompts, sinks, strict=True):
            backend.submit(prompt, SamplingParams(max_new_tokens=1), sink)
        for sink in sinks:
            assert sink.done.wait(60)
            assert sink.result is not None and sink.result.error is None
            assert sink.result.cached_tokens == 0
    finally:
        backend.close(10)


def test_a_stop_during_the_warm_up_aborts_the_rest_and_releases_everything(
    make_engine: Callable[..., Engine],
) -> None:
    backend = EngineBackend(make_engine(max_running=1), MODEL, SIZING["gpu_memory"])  # one at a time: most wait
    try:
        report = warm_up(backend, stop=lambda: True)
        assert report.timed_out and report.reserved_bytes == 0  # a stopped warm-up reserves nothing
        m = backend.metrics()
        assert m["aborted"] >= 1  # at least the first still-open request was aborted, not waited for
        assert (m["running"], m["waiting"], m["held_pages"], m["held_slots"]) == (0, 0, 0, 0)
    finally:
        backend.close(10)
