"""The engine thread -> event loop bridge (``generation``) on a real ``EngineBackend``: how often the loop
is woken, and that every token and the end arrive, in order, either way."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from hybridkv.engine.engine import Engine
from hybridkv.engine.sched.request import FinishReason, Outcome, SamplingParams
from hybridkv.server import ByteTokenizer, EngineBackend
from hybridkv.server.generation import STOPPED, Generation, LoopPost, Update, Writer
from hybridkv.server.stops import Stops
from tests.server.conftest import MODEL, SIZING

PROMPT = list(range(3, 40))
NEW = 8


async def _follow(
    backend: EngineBackend,
    stream: bool,
    pipe: bool = False,
    closed: bool = False,
    reader_gone: bool = False,
    direct: bool = False,
    writer: Writer | None = None,
    attach_after: int = 0,
) -> tuple[list[list[int]], int, Generation]:
    """The tokens of each burst ``updates`` gave, and how many times the loop was woken (``pipe``: through
    the connected wake-up pipe, else ``call_soon_threadsafe``; ``closed``: the pipe connected, then closed;
    ``reader_gone``: connected, then its read end closed behind the post's back; ``direct``: a direct stream,
    ``writer`` attached (None: the loop writes it) once ``attach_after`` tokens were kept)."""
    post = LoopPost(asyncio.get_running_loop())
    if pipe or closed or reader_gone:
        await post.connect()
    if closed:
        post.close()
    if reader_gone:
        assert post._reader is not None
        post._reader.close()
        await asyncio.sleep(0.01)  # the transport closes its fd
    wakes = 0
    deliver = post._deliver

    def counted() -> None:
        nonlocal wakes
        wakes += 1
        deliver()

    post._deliver = counted  # type: ignore[method-assign]
    gen = Generation(backend, post, [PROMPT], stream, direct=direct)
    gen.start([SamplingParams(max_new_tokens=NEW, ignore_eos=True)], f"salt-{stream}-{direct}-{writer is None}")
    if direct:
        deadline = time.monotonic() + 30
        while len(gen._events) < attach_after:  # the loop busy: the engine thread's first steps come first
            assert time.monotonic() < deadline
            time.sleep(0.001)
        gen.attach(writer)
    bursts = []
    try:
        async with asyncio.timeout(60):
            async for updates in gen.updates():
                bursts += [up.new_tokens for up in updates]
    finally:
        gen.detach()
        post.close()
    return bursts, wakes, gen


def test_a_plain_generation_wakes_the_loop_once_a_stream_once_per_step(make_engine: Callable[..., Engine]) -> None:
    backend = EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"])
    try:
        reference = list(make_engine().generate([PROMPT], NEW, stop_at_eos=False)[0].output_ids)
        plain, plain_wakes, gen = asyncio.run(_follow(backend, stream=False))
        assert plain_wakes == 1 and plain == [reference]  # every token rode along with the end
        p = gen.progress[0]
        assert p.finished is not None and p.finished.finish_reason is FinishReason.LENGTH
        assert p.first_at is not None and p.last_at is not None and p.first_at < p.last_at  # stamped per token
        streamed, stream_wakes, _ = asyncio.run(_follow(backend, stream=True))
        # one wake-up per step, each with its token, the end with the last (its max_new_tokens-th token waits for
        # it); a loop slower than a step on a busy machine takes two steps' tokens in one wake-up, never more
        assert stream_wakes == len(streamed) and NEW // 2 < len(streamed) <= NEW
        assert [t for burst in streamed for t in burst] == reference
    finally:
        backend.close(10)


def test_the_wake_up_pipe_wakes_once_per_step_and_closes(make_engine: Callable[..., Engine]) -> None:
    backend = EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"])
    fds = len(os.listdir("/proc/self/fd"))
    try:
        reference = list(make_engine().generate([PROMPT], NEW, stop_at_eos=False)[0].output_ids)
        for _ in range(3):  # each connect opens a pipe, each close closes both ends
            streamed, wakes, _ = asyncio.run(_follow(backend, stream=True, pipe=True))
            assert wakes == len(streamed) and NEW // 2 < len(streamed) <= NEW  # (as above)
            assert [t for burst in streamed for t in burst] == reference
            plain, plain_wakes, _ = asyncio.run(_follow(backend, stream=False, pipe=True))
            assert plain_wakes == 1 and plain == [reference]
        assert len(os.listdir("/proc/self/fd")) == fds
        # closed, the post wakes the loop as before it was connected
        streamed, wakes, _ = asyncio.run(_follow(backend, stream=True, closed=True))
        assert wakes == len(streamed) and [t for burst in streamed for t in burst] == reference
        # its read end gone without close: a failed write falls back the same way
        streamed, wakes, _ = asyncio.run(_follow(backend, stream=True, reader_gone=True))
        assert wakes == len(streamed) and [t for burst in streamed for t in burst] == reference
    finally:
        backend.close(10)


def test_a_running_server_wakes_its_loop_through_the_pipe(start_server: Callable[..., Any]) -> None:
    server = start_server()
    post = server.state._post
    assert post is not None and post._wake_fd is not None and post.loop.is_running()
    r = httpx.post(f"{server.url}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    assert server.state._post is post  # the connected one served it
    server.stop()
    assert post._wake_fd is None  # closed with the loop


def test_a_direct_stream_is_written_by_the_backend_thread_and_wakes_the_loop_once_unless_handed_back(
    make_engine: Callable[..., Engine],
) -> None:
    backend = EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"])
    try:
        reference = list(make_engine().generate([PROMPT], NEW, stop_at_eos=False)[0].output_ids)
        loop_thread = threading.get_ident()
        writes: list[tuple[int, list[int], bool]] = []

        def writer(updates: list[Update]) -> bool:
            (up,) = updates
            writes.append((threading.get_ident(), up.new_tokens, up.finished is not None))
            return True

        left, wakes, gen = asyncio.run(_follow(backend, True, pipe=True, direct=True, writer=writer))
        assert wakes == 1 and left == [] and gen.done  # the loop was woken once, to end it: nothing left to write
        assert [t for _, tokens, _ in writes for t in tokens] == reference
        assert [len(tokens) for _, tokens, _ in writes] == [1] * NEW  # a chunk per token, the end with the last
        assert [ended for _, _, ended in writes] == [False] * (NEW - 1) + [True]
        assert all(thread != loop_thread for thread, _, _ in writes[1:])  # (the first: maybe by attach, in the loop)
        # attached late, after several steps: what was kept is written a chunk per step still, by the loop
        writes.clear()
        asyncio.run(_follow(backend, True, pipe=True, direct=True, writer=writer, attach_after=3))
        assert [t for _, tokens, _ in writes for t in tokens] == reference
        assert [len(tokens) for _, tokens, _ in writes] == [1] * NEW
        assert writes[0][0] == loop_thread and writes[-1][0] != loop_thread
        # no writer (uvicorn's connection did not allow one): the loop writes it, tokens in order, once per step
        streamed, wakes, _ = asyncio.run(_follow(backend, True, pipe=True, direct=True))
        assert [t for burst in streamed for t in burst] == reference and wakes == len(streamed) <= NEW
        # a writer that hands the stream back (its socket took two chunks, then was full): no more chunks for it
        written: list[list[int]] = []

        def full_after_two(updates: list[Update]) -> bool:
            (up,) = updates
            written.append(up.new_tokens)
            return len(written) < 2

        rest, wakes, gen = asyncio.run(_follow(backend, True, pipe=True, direct=True, writer=full_after_two))
        assert len(written) == 2 and gen.done
        assert [t for tokens in written + rest for t in tokens] == reference  # the loop took the rest, in order
        assert wakes == len(rest) >= 1
    finally:
        backend.close(10)


def test_a_writer_that_raises_fails_the_stream_in_the_loop_and_the_request_is_freed(
    make_engine: Callable[..., Engine],
) -> None:
    backend = EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"])
    try:
        calls = 0

        def writer(updates: list[Update]) -> bool:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("the encoder broke")
            return True

        long = SamplingParams(max_new_tokens=200, ignore_eos=True)

        async def follow() -> Generation:
            post = LoopPost(asyncio.get_running_loop())
            gen = Generation(backend, post, [PROMPT], stream=True, direct=True)
            gen.start([long], "salt-raises")
            gen.attach(writer)
            try:
                async with asyncio.timeout(60):
                    with pytest.raises(RuntimeError, match="the encoder broke"):
                        async for _ in gen.updates():
                            pass
            finally:
                gen.abort("the stream failed")  # what ServerState.release does
            return gen

        gen = asyncio.run(follow())
        assert calls == 2  # nothing written after the failure
        deadline = time.monotonic() + 30
        while backend.metrics()["running"] or backend.metrics()["held_pages"]:  # the request's memory comes back
            assert time.monotonic() < deadline, backend.metrics()
            time.sleep(0.02)
        assert len(gen.progress[0].tokens) < 200
    finally:
        backend.close(10)


class Scripted:
    """A backend that hands its tokens over from ``submit`` itself (``early``: before the ticket is known) or when
    ``play``ed; ends with ``length``, or ``abort`` once one was asked."""

    def __init__(self, tokens: list[int], early: bool):
        self.tokens, self.early = tokens, early
        self.aborts: list[tuple[int, str]] = []

    def submit(self, prompt: list[int], params: SamplingParams, sink: Any, salt: str | None = None) -> int:
        self.sink = sink
        if self.early:
            self.play()
        return 7

    def abort(self, ticket: int, reason: str) -> None:
        self.aborts.append((ticket, reason))

    def play(self) -> None:
        for t in self.tokens:
            self.sink.on_token(t)
        reason = FinishReason.ABORT if self.aborts else FinishReason.LENGTH
        self.sink.on_finish(Outcome(list(self.tokens), reason, "aborted" if self.aborts else None, 1, 0))


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize(
    ("stops", "text", "reason"),
    [
        (("XY", "never"), "ab", FinishReason.STOP),
        (("cdX",), "abXYcd", FinishReason.LENGTH),  # "cd" held to the end, then let out
    ],
)
def test_a_stop_string_aborts_its_request_once_and_drops_what_comes_after(
    early: bool, stops: tuple[str, ...], text: str, reason: FinishReason
) -> None:
    backend = Scripted(list(b"abXYcd"), early)

    async def run() -> tuple[Generation, list[str]]:
        post = LoopPost(asyncio.get_running_loop())
        gen = Generation(backend, post, [[1]], True, tokenizer=ByteTokenizer(256), stops=[Stops(stops)])  # type: ignore[arg-type]
        gen.start([SamplingParams(max_new_tokens=8)], None)
        if not early:
            threading.Thread(target=backend.play).start()
        deltas = []
        async with asyncio.timeout(30):
            async for updates in gen.updates():
                deltas += [up.text for up in updates]
        return gen, deltas

    gen, deltas = asyncio.run(run())
    got = gen.progress[0]
    assert got.finished is not None and got.finished.finish_reason is reason and got.text == text == "".join(deltas)
    if reason is FinishReason.STOP:
        assert backend.aborts == [(7, STOPPED)]  # by its sink, or by ``start`` when it matched before the ticket
        assert got.tokens == list(b"abXY") and got.finished.output_ids == got.tokens
        assert got.finished.stop_string == "XY" and got.finished.error is None
    else:
        assert backend.aborts == [] and got.tokens == list(b"abXYcd") and got.finished.stop_string is None


class Undecodable(ByteTokenizer):
    def decode(self, ids: list[int]) -> str:
        if 0x99 in ids:
            raise ValueError("no text for 0x99")
        return super().decode(ids)


def test_a_token_its_stop_sink_cannot_decode_fails_that_request_alone() -> None:
    backend = Scripted([*b"ab", 0x99, *b"cd"], early=False)

    async def run() -> Generation:
        post = LoopPost(asyncio.get_running_loop())
        gen = Generation(backend, post, [[1]], False, tokenizer=Undecodable(256), stops=[Stops(("XY",))])  # type: ignore[arg-type]
        gen.start([SamplingParams(max_new_tokens=8)], None)
        threading.Thread(target=backend.play).start()  # the sink raising in it would end this thread, uncaught
        async with asyncio.timeout(30):
            async for _ in gen.updates():
                pass
        return gen

    got = asyncio.run(run()).progress[0]
    assert got.finished is not None and got.finished.finish_reason is FinishReason.ERROR
    assert "could not be decoded (ValueError: no text for 0x99)" in str(got.finished.error)
    assert got.tokens == list(b"ab") and got.text == "ab"
    assert backend.aborts == [(7, got.finished.error)]
