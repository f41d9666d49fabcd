"""Generation: one HTTP request's prompts in a backend, bridged from the backend's thread to asyncio.

The backend calls each prompt's sink from its own thread; the sink stamps the time and hands the
event to the event loop through the loop's ``LoopPost``: one wake-up per burst (a step's tokens
for every request), not per token, so the loop thread takes the GIL from the
engine thread once per step. A generation that is not streamed wakes the loop only when a prompt
ends (its tokens ride along with that wake-up), so the loop costs it nothing per token. A streamed one
wakes it for a prompt's first token, then every ``stream_interval`` tokens (1: every token), and at its
end; the tokens between ride along. ``next`` (one chunk) and ``updates`` (every one) give every
prompt's new tokens and its end together, so a stream sends one chunk for a token and the end that
came with it, and a slow client gets several tokens per chunk. A ``direct`` stream wakes the loop only
for its last end: its events are kept here, and once the consumer ``attach``es a writer (``sse.py``),
each chunk is written by the backend's thread itself, as the event that closes it arrives.

Text: each ``Update`` carries its prompt's new text (``Progress.text``: all so far), decoded as the update is
taken (``TextStream``), but for a prompt with stop strings (``stops``): its sink decodes each token in the
backend's thread (``StopText``), so that the token completing a stop string ends the request there: the
backend aborts it (its memory back), the tokens that still come are dropped, and its end is reported as
``stop`` (``Outcome.stop_string``) with the tokens up to the match; its text never goes past the match.

Invariants:
- ``start`` submits every prompt or none: a refusal of prompt ``i`` aborts prompts ``0..i-1``.
- Every submitted prompt ends exactly once (``finished[i]``); ``abort`` ends the open ones (the
  backend releases their memory) and is a no-op for ended ones, so a disconnect at any moment
  leaves nothing held.
- Events of one generation reach it in the order the backend posted them (one FIFO per loop); a
  direct one's are kept in order under its lock, and each is applied (``_take``) by exactly one thread.
- A direct stream's chunks are written by one thread at a time, in order, the last one before the loop
  is woken to end the response; after ``detach`` nothing more is written for it.
- Timings are ``perf_counter`` stamps taken in the backend's thread as the token is handed over.
- A prompt whose text matched a stop string is aborted once (by its sink, or by ``start`` if the match came
  before its ticket), ends with ``stop``, and its tokens, log-probabilities and text stop at the match; one whose
  text its sink cannot decode is aborted alike and ends with ``error`` (the backend's thread never raises).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from hybridkv.engine.logprobs import TokenLogprob
from hybridkv.engine.sched.request import FinishReason, Outcome, RequestError, SamplingParams
from hybridkv.server.backend import Backend
from hybridkv.server.stops import Stops, StopText
from hybridkv.server.text import TextStream, TextTokenizer

STOPPED = "its text matched a stop string"
"""Why a request whose text matched a stop string is aborted in the backend (its answer ends with ``stop``)."""


@dataclass
class Progress:
    """One prompt's state as the loop sees it."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the text released so far
    first_at: float | None = None
    last_at: float | None = None
    finished: Outcome | None = None
    finished_at: float | None = None


@dataclass
class Update:
    index: int
    new_tokens: list[int]
    finished: Outcome | None
    text: str = ""  # the text they add


Event = tuple[int, int | None, Outcome | None, float, bool, str]
"""Prompt index, token, end, ``perf_counter`` stamp, whether it closes a chunk (``Generation.post`` decides), and
the text it releases (a prompt with stop strings; the others' is decoded as it is taken)."""

Writer = Callable[[list["Update"]], bool]
"""Writes one chunk's updates to the client, from the backend's thread (``Generation.attach``); False: the loop
writes the rest of the stream (the client is slow, or its connection failed)."""


_write_holding_gil = ctypes.PyDLL(None).write
"""write(2) called without releasing the GIL (a ``PyDLL`` function keeps it): ``os.write`` releases it, and
the loop thread, often waiting for it at that moment, takes it in the middle of the engine thread's post,
which then waits to get it back: measured, 17 more context switches per streamed request on each thread."""
_write_holding_gil.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
_write_holding_gil.restype = ctypes.c_ssize_t


class _Wake(asyncio.Protocol):
    """The read end of a ``LoopPost``'s wake-up pipe: each read (one or more bytes) is one delivery."""

    def __init__(self, post: LoopPost):
        self.post = post

    def data_received(self, data: bytes) -> None:
        self.post._deliver()


class LoopPost:
    """Events from other threads into one event loop's generations, one wake-up per burst.

    Once ``connect``ed, a wake-up is one byte on a pipe the loop reads with a transport of its own:
    uvloop reads it in C and enters Python once (``data_received`` delivers the burst), where
    ``call_soon_threadsafe`` enters it twice (its wake-up handler, then the callback), each entry
    taking the GIL from the engine thread again. Measured on the 2 shared cores (bench serve's one-by-one
    requests, both servers up, alternating per request, 64-256 requests a run): HTTP end-to-end, median
    of the paired differences, 0.4-4.4 ms lower in 6 of 7 runs, 2.2 ms higher in one; the loop's CPU
    per request the same within noise. Not connected (yet, or any more), it wakes the loop with
    ``call_soon_threadsafe``.
    Every use of the pipe's write end is under ``_lock``, so ``close`` never races a write.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Generation, Event | None]] = []
        self._scheduled = False
        self._wake_fd: int | None = None  # the pipe's write end (under _lock)
        self._reader: asyncio.BaseTransport | None = None

    async def connect(self) -> None:
        """In the loop: wake it through a pipe from now on (until ``close``)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self._reader, _ = await self.loop.connect_read_pipe(lambda: _Wake(self), os.fdopen(read_fd, "rb", 0))
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            raise
        with self._lock:
            self._wake_fd = write_fd

    def close(self) -> None:
        """In the loop: back to ``call_soon_threadsafe`` wake-ups; the pipe closed."""
        with self._lock:
            if self._wake_fd is not None:
                os.close(self._wake_fd)
                self._wake_fd = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def post(self, gen: Generation, event: Event | None, wake: bool) -> None:
        """Queue ``event`` for ``gen`` (``None``: only wake it); ``wake``: deliver it soon (else with the next
        wake-up, any gen's)."""
        with self._lock:
            self._pending.append((gen, event))
            if self._scheduled or not wake:
                return
            self._scheduled = True
            # at most one byte per delivery: the pipe never fills; a failed write (its read end gone: the
            # loop closed without ``close``) falls back to call_soon_threadsafe
            if self._wake_fd is not None and _write_holding_gil(self._wake_fd, b"\0", 1) == 1:
                return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for these any more
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            burst, self._pending = self._pending, []
            self._scheduled = False
        for gen, event in burst:
            gen.arrive(event)


class PromptRefused(Exception):
    """The backend refused prompt ``index`` of a request (``error`` names the field)."""

    def __init__(self, index: int, error: RequestError):
        super().__init__(str(error))
        self.index = index
        self.error = error


class _Sink:
    def __init__(self, gen: Generation, index: int, text: StopText | None):
        self.gen = gen
        self.index = index
        self.text = text  # the prompt's stop strings, matched here (None: it has none)
        self.ticket: int | None = None  # known once ``submit`` returned (under the generation's _lock)
        self.kept = 0  # tokens handed on: up to the match, when one came
        self.failure: str | None = None  # why its text could not be decoded (it fails alone, not the backend)

    @property
    def cut(self) -> bool:
        """Its text matched a stop string or could not be decoded: its request is to end (``Generation.stop``)."""
        return self.failure is not None or (self.text is not None and self.text.matched is not None)

    def _push(self, tokens: list[int], final: bool) -> str:
        """The text ``tokens`` release; a decoding error fails this request alone (the backend's thread must not
        raise: that fails every request)."""
        assert self.text is not None
        try:
            return self.text.push(tokens, final)
        except Exception as exc:
            self.failure = f"its output could not be decoded ({type(exc).__name__}: {exc})"
            return ""

    def on_token(self, token: int, logprob: TokenLogprob | None = None) -> None:
        delta = ""
        if self.text is not None:
            if self.cut:
                return  # past the match (or a failed decoding): the abort is on its way
            delta = self._push([token], final=False)
            if self.failure is not None:
                self.gen.stop(self)
                return
        if logprob is not None:
            self.gen.logprobs[self.index].append(logprob)  # before the token's event: there when it is applied
        self.kept += 1
        cut = self.cut
        self.gen.post(self.index, token, None, delta, last=cut)
        if cut:
            self.gen.stop(self)

    def on_finish(self, result: Outcome) -> None:
        text = self.text
        if text is None:
            self.gen.post(self.index, None, result)
            return
        delta = "" if self.cut else self._push([], final=True)
        if self.failure is not None:
            result = dataclasses.replace(result, finish_reason=FinishReason.ERROR, error=self.failure)
        elif text.matched is not None:  # however it ended (the abort, or its own end), it stopped at the match
            result = dataclasses.replace(
                result,
                output_ids=result.output_ids[: self.kept],
                finish_reason=FinishReason.STOP,
                error=None,
                stop_string=text.matched,
                logprobs=None if result.logprobs is None else result.logprobs[: self.kept],
            )
        self.gen.post(self.index, None, result, delta)


class Generation:
    def __init__(
        self,
        backend: Backend,
        post: LoopPost,
        prompts: list[list[int]],
        stream: bool,
        stream_interval: int = 1,
        direct: bool = False,
        tokenizer: TextTokenizer | None = None,
        stops: Sequence[Stops | None] = (),
    ):
        """``stream``: the consumer wants the tokens as they come, a chunk per ``stream_interval`` of them (else
        only the ends wake the loop). ``direct`` (a stream): its events stay here, not posted to the loop, until
        the consumer ``attach``es a writer for the backend's thread (or none: then the loop writes, as for any
        other stream). ``tokenizer``: the text of the updates (None: ``""``); ``stops``: per prompt, its stop
        strings (None or missing: none; they need the tokenizer)."""
        self.backend = backend
        self.loop_post = post
        self.prompts = prompts
        self.stream = stream
        self.stream_interval = stream_interval
        self.direct = direct
        self._posted = [0] * len(prompts)  # tokens posted per prompt (the backend's thread only)
        self._max_new = [0] * len(prompts)  # each prompt's max_new_tokens (``start``)
        self._ended = 0  # prompts whose end was posted (under _lock)
        self._ready = False  # an event that closes a chunk arrived since ``next`` last returned (the loop only)
        self.arrived = time.perf_counter()
        self.progress = [Progress() for _ in prompts]
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in prompts]
        """Per prompt, its tokens' log-probabilities so far when it asked (appended by the backend's thread)."""
        self.tickets: list[int] = []
        self._lock = threading.Lock()  # guards _events, _keep, _writer and the progress ``_take`` applies
        self._events: list[Event] = []  # arrived, not yet taken
        self._keep = direct  # events are kept in _events by the backend's thread, not posted (``attach`` may stop it)
        self._writer: Writer | None = None  # set by ``attach``: chunks are written in the backend's thread
        self._failure: BaseException | None = None  # what the writer raised (``next`` raises it in the loop)
        self._waiter: asyncio.Future[None] | None = None
        self._open = len(prompts)
        self._sinks: list[_Sink] = []
        self._texts: list[TextStream | None] = []  # per prompt without stop strings: its text, decoded in ``_take``
        for i in range(len(prompts)):
            spec = stops[i] if i < len(stops) else None
            stop_text = None
            if spec is not None:
                assert tokenizer is not None, "stop strings need a tokenizer (``stop_strings`` refuses them without)"
                stop_text = StopText(tokenizer, spec)
            self._sinks.append(_Sink(self, i, stop_text))
            self._texts.append(TextStream(tokenizer) if spec is None else None)

    def start(self, params: list[SamplingParams], cache_salt: str | None) -> None:
        """Submit every prompt; on a refusal (``PromptRefused``, ``QueueFull``, ``BackendClosed``) abort
        what was submitted and re-raise."""
        self._max_new = [p.max_new_tokens for p in params]
        try:
            for i, (prompt, p) in enumerate(zip(self.prompts, params, strict=True)):
                sink = self._sinks[i]
                try:
                    ticket = self.backend.submit(prompt, p, sink, cache_salt)
                except RequestError as exc:
                    raise PromptRefused(i, exc) from None
                self.tickets.append(ticket)
                with self._lock:
                    sink.ticket = ticket
                    cut = sink.cut
                if cut:  # before its ticket was known: its sink could not abort it
                    self.backend.abort(ticket, sink.failure or STOPPED)
        except BaseException:
            self.abort("another prompt of the same request was refused")
            raise

    def stop(self, sink: _Sink) -> None:
        """From the backend's thread: ``sink``'s text matched a stop string (or could not be decoded); end its
        request (once its ticket is known: else ``start`` does)."""
        with self._lock:
            ticket = sink.ticket
        if ticket is not None:
            self.backend.abort(ticket, sink.failure or STOPPED)

    def _ends_chunk(self, index: int, token: int | None, finished: Outcome | None, last: bool) -> bool:
        """Whether this event closes a chunk for the consumer: an end; when streamed, a prompt's first token and every
        ``stream_interval``-th (counted here, in the backend's thread), but its ``max_new_tokens``-th or ``last``: its
        end follows at once and closes the chunk with it (one write, not two)."""
        if token is None or not self.stream:
            return finished is not None
        n = self._posted[index] = self._posted[index] + 1
        if n == self._max_new[index] or last:
            return False
        return n == 1 or n % self.stream_interval == 0

    def post(self, index: int, token: int | None, finished: Outcome | None, text: str = "", last: bool = False) -> None:
        """From the backend's thread: hand one event to the loop (dropped once the loop is closed); only an event
        that closes a chunk wakes it. Direct: keep it here; once a writer is attached, an event that closes a
        chunk writes it, and the last end, written too, wakes the loop (it ends the response). ``text``: what it
        releases (a prompt with stop strings); ``last``: the prompt's last token (its end follows)."""
        ends = self._ends_chunk(index, token, finished, last)
        event: Event = (index, token, finished, time.perf_counter(), ends, text)
        with self._lock:
            self._ended += finished is not None
            if self._keep:
                self._events.append(event)
                if not ends:
                    return
                last = self._ended == len(self.prompts)
                if self._writer is None and not last:
                    return  # ``attach`` will write it
                if self._writer is not None and self._write() and not last:
                    return
                self.loop_post.post(self, None, True)  # over (written or not), or the writer failed: the loop goes on
                return
        self.loop_post.post(self, event, ends)

    def attach(self, writer: Writer | None) -> None:
        """In the loop, once the response's head is written (``direct`` only): ``writer`` writes every chunk from
        the backend's thread from now on, starting with any already waiting here, a chunk per event that closes
        one, as if written as they came (but a generation already over: the loop writes it); ``None``: the loop
        writes them (the events kept so far come first)."""
        with self._lock:
            self._writer = writer
            self._keep = writer is not None
            if writer is not None and self._ended < len(self.prompts):
                while self._writer is not None:
                    closes = next((i for i, e in enumerate(self._events) if e[4]), None)
                    if closes is None:
                        return
                    if not self._write(closes + 1):
                        break
            if self._failure is not None or any(e[4] for e in self._events):  # the loop goes on from here
                self._ready = True

    def detach(self) -> None:
        """In the loop, once the consumer is done (however it ended): nothing is written for it any more; later
        events are only kept."""
        with self._lock:
            self._writer = None
            self._keep = False

    def _write(self, count: int | None = None) -> bool:
        """Under ``_lock``: the first ``count`` events kept (None: all) written by the writer as one chunk; if it
        answers False, the loop takes the stream over from the next event on. False if it raised (kept for
        ``next``, which the caller wakes; the loop takes over too)."""
        assert self._writer is not None
        try:
            direct = self._writer(self._take(count))
        except Exception as exc:
            self._failure = exc
            direct = False
        if not direct:
            self._writer = None
            self._keep = False
        return self._failure is None

    def arrive(self, event: Event | None) -> None:
        """In the loop: one delivered event (``None``: only a wake-up); one that closes a chunk wakes ``updates``
        (the others wait for it, even when another generation's wake-up brought them)."""
        if event is not None:
            with self._lock:
                self._events.append(event)
            if not event[4]:
                return
        self._ready = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abort(self, reason: str) -> None:
        for i, ticket in enumerate(self.tickets):
            if self.progress[i].finished is None:
                self.backend.abort(ticket, reason)

    @property
    def done(self) -> bool:
        return self._open == 0

    def _apply(self, index: int, token: int | None, finished: Outcome | None, at: float) -> None:
        p = self.progress[index]
        if token is not None:
            p.tokens.append(token)
            p.first_at = p.first_at or at
            p.last_at = at
        if finished is not None:
            p.finished = finished
            p.finished_at = at
            self._open -= 1

    async def next(self) -> list[Update]:
        """What changed since the last call (one ``Update`` per prompt that changed), waiting until an event closes
        a chunk (``_ends_chunk``) if none did; call it only while not ``done``. Raises what an attached writer
        raised."""
        if not self._ready:
            self._waiter = self.loop_post.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._ready = False
        if self._failure is not None:
            raise self._failure
        with self._lock:
            return self._take()

    def _take(self, count: int | None = None) -> list[Update]:
        """Under ``_lock``: the first ``count`` events so far (None: all) applied to ``progress``, as one ``Update``
        per prompt that changed."""
        n = len(self._events) if count is None else count
        events, self._events = self._events[:n], self._events[n:]
        changed: dict[int, Update] = {}
        for index, token, finished, at, _, text in events:
            self._apply(index, token, finished, at)
            up = changed.get(index)
            if up is None:
                up = changed[index] = Update(index, [], None)
            if token is not None:
                up.new_tokens.append(token)
            if finished is not None:
                up.finished = finished
            up.text += text
        for up in changed.values():
            stream = self._texts[up.index]
            if stream is not None:  # no stop strings: decoded here
                up.text = stream.push(up.new_tokens, final=up.finished is not None)
            self.progress[up.index].text += up.text
        return list(changed.values())

    async def updates(self) -> AsyncIterator[list[Update]]:
        """Until every prompt ended: per wake-up, what changed (``next``)."""
        while not self.done:
            yield await self.next()
