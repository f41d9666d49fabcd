"""EngineBackend: one single-process ``Engine`` owned by one background thread.

Any thread submits, aborts or asks for metrics through a bounded inbox; the engine thread drains
the inbox between steps (so the engine is only ever touched by it), steps while it has work and
sleeps on a condition variable when idle. Tokens and ends go to each request's ``Sink`` right after
the step that produced them.

A burst that wakes an idle engine may be gathered before the first step (``gather_gap_s``, ``gather_max_s``; off
by default): clients that send many requests at once reach the engine one by one, as the event loop parses each,
and a step started on the first leaves the rest to the next. With gathering on, once a submission wakes an idle
engine the thread waits while more keep arriving, each within ``gather_gap_s`` of the last, and at most
``gather_max_s`` in all; a lone request pays one gap. A busy engine takes new requests at its next step either way.
Measured (``hybridkv serve``, widened tiny-gemma3-dense fp32, one thread, 2-core Zen 5, the ``bench serve --peer``
workloads, 6 bursts each, off -> 2 ms): 64 requests on a cached 128-token prefix + 16 of their own: the first step
took 1 to 64 of them and TTFT p50 ranged 117-270 ms; gathered, all 64 and 180-188 ms, 111 -> 114 requests/s;
64 fresh 128-token prompts: 38.8 -> 40.0 requests/s but TTFT p50 818 -> 880 ms; one request alone 103 -> 106 ms.
Again once decodes rode on top of the step budget (``bench serve --peer vllm``, widened Gemma 3 fp32, 3 rounds):
random TTFT p50 steady at 708-712 ms gathered, 568-716 ms not (the 32nd and 33rd first tokens of a full first step
straddle the second step's end every time). A trade, not a gain: off unless asked for (``hybridkv serve
--gather-ms``), for clients that send batches at once.

Invariants:
- Open requests (submitted, not yet ended) never exceed ``max_running + max_queued``: one more is
  refused with ``QueueFull`` before anything is queued.
- A prompt is checked once, by ``submit`` (``check_request``); the engine takes its ``CheckedPrompt`` as is.
- Every ticket handed out ends exactly once through its sink (finished, aborted, failed, or
  aborted by ``close``); a ticket's engine request id is known only to the engine thread.
- An exception out of ``Engine.step`` is a bug: every open request fails with it, the backend is
  ``broken`` (new submits raise ``BackendClosed``), and the thread exits; the traceback goes to
  the server log, never to a client.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from hybridkv.engine.engine import Engine
from hybridkv.engine.sched.request import CheckedPrompt, FinishReason, Outcome, SamplingParams, check_request
from hybridkv.server.backend import BackendClosed, ModelInfo, QueueFull, Sink


@dataclass
class _Submit:
    ticket: int
    prompt: CheckedPrompt
    sink: Sink
    cache_salt: str | None


@dataclass
class _Abort:
    ticket: int
    reason: str


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: Future[Any]


@dataclass
class _Open:
    ticket: int
    sink: Sink
    prompt_tokens: int


GATHER_GAP_S = 0.0
"""How long an idle engine waits for the next request of a burst (``0``: it steps at once; the module says why)."""
GATHER_MAX_S = 0.05
"""How long it gathers one burst, at most."""


class EngineBackend:
    def __init__(
        self,
        engine: Engine,
        name: str,
        memory_budget: str,
        max_queued: int = 256,
        gather_gap_s: float = GATHER_GAP_S,
        gather_max_s: float = GATHER_MAX_S,
    ):
        if not (0 <= gather_gap_s <= gather_max_s):
            raise ValueError(f"gather gap {gather_gap_s} s and most {gather_max_s} s: give 0 <= gap <= most")
        self.gather_gap_s, self.gather_max_s = gather_gap_s, gather_max_s
        self.engine = engine
        self.info = ModelInfo(name, engine.vocab_size, engine.max_context, memory_budget, engine.eos)
        self.capacity = engine.options.max_running + max_queued
        self.broken: str | None = None
        self._cond = threading.Condition()
        self._inbox: deque[_Submit | _Abort | _Call] = deque()
        self._open_count = 0  # tickets handed out and not ended (under _cond)
        self._next_ticket = 0
        self._closing = False
        self._stopped = False
        self._open: dict[Hashable, _Open] = {}  # engine rid -> request (engine thread only)
        self._rid_of: dict[int, Hashable] = {}  # ticket -> engine rid (engine thread only)
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    # --- any thread -------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, sink: Sink, cache_salt: str | None = None) -> int:
        checked = check_request(prompt, params, self.info.vocab_size, self.info.max_context)
        with self._cond:
            if self._closing or self.broken is not None:
                raise BackendClosed(self.broken or "the server is shutting down")
            if self._open_count >= self.capacity:
                raise QueueFull(f"{self._open_count} requests are open, the most this server queues; retry later")
            self._open_count += 1
            ticket = self._next_ticket
            self._next_ticket += 1
            self._inbox.append(_Submit(ticket, checked, sink, cache_salt))
            self._cond.notify()
        return ticket

    def abort(self, ticket: int, reason: str) -> None:
        with self._cond:
            self._inbox.append(_Abort(ticket, reason))
            self._cond.notify()

    def call(self, fn: Callable[[Engine], Any], timeout_s: float = 30.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps; its result (or its exception)."""
        future: Future[Any] = Future()
        with self._cond:
            if self._stopped:
                raise BackendClosed(self.broken or "the engine thread has stopped")
            self._inbox.append(_Call(fn, future))
            self._cond.notify()
        return future.result(timeout_s)

    def health(self) -> str | None:
        return self.broken or ("the server is shutting down" if self._closing else None)

    def metrics(self) -> dict[str, Any]:
        return self.call(_engine_metrics)

    def flush_cache(self, host: bool) -> str | None:
        return self.call(lambda engine: self._flush(engine, host))

    def reserve(self) -> int:
        return int(self.call(lambda engine: engine.reserve_step_buffers()))

    def describe(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "page_size": engine.mem.page_size,
            "chunked_prefill_size": engine.options.chunk_size,
            "max_prefill_tokens": engine.options.step_tokens,
            "max_running_requests": engine.options.max_running,
            "max_total_num_tokens": (engine.mem.pages.capacity - 1) * engine.mem.page_size,  # page 0: the sink
            "disable_radix_cache": not engine.kv.prefix_cache,
            "tiers": engine.tiers is not None,
        }

    def close(self, timeout_s: float) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            print(f"hybridkv: the engine thread did not stop within {timeout_s} s", file=sys.stderr)

    # --- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    idle = not engine.has_work()
                    while not self._inbox and not engine.has_work() and not self._closing:
                        self._cond.wait()
                    if idle and self.gather_gap_s > 0 and any(isinstance(i, _Submit) for i in self._inbox):
                        self._gather()
                    items = list(self._inbox)
                    self._inbox.clear()
                    closing = self._closing
                for item in items:
                    self._take(item)
                if closing:
                    for rid in list(self._open):
                        self._end(engine.abort(rid, "the server shut down"))
                    return
                if engine.has_work():
                    got = engine.step()
                    logprobs = got.logprobs
                    for rid, token in got.tokens:
                        self._open[rid].sink.on_token(token, logprobs.get(rid) if logprobs else None)
                    for out in got.finished:
                        self._end(out)
        except Exception as exc:  # a bug in the engine: fail everyone, refuse the rest
            traceback.print_exc(file=sys.stderr)
            self.broken = f"the engine failed ({type(exc).__name__}: {exc}); restart the server"
            for rid in list(self._open):
                self._fail(rid, self.broken)
        finally:
            with self._cond:
                self._stopped = True
                items = list(self._inbox)
                self._inbox.clear()
            for item in items:  # what came in after the last drain: refused or answered
                if isinstance(item, _Submit):
                    item.sink.on_finish(
                        Outcome([], FinishReason.ABORT, "the server shut down", len(item.prompt.ids), 0)
                    )
                    self._release()
                elif isinstance(item, _Call):
                    item.future.set_exception(BackendClosed(self.broken or "the engine thread has stopped"))

    def _gather(self) -> None:
        """Under the lock, the engine idle and a submission just in: wait while submissions keep arriving, each
        within ``gather_gap_s`` of the last, for ``gather_max_s`` at most (the module)."""
        deadline = time.monotonic() + self.gather_max_s
        seen = len(self._inbox)
        while not self._closing:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            woken = self._cond.wait(min(self.gather_gap_s, left))
            if not woken and len(self._inbox) == seen:
                return  # a gap with nothing new: the burst is over
            seen = len(self._inbox)

    def _take(self, item: _Submit | _Abort | _Call) -> None:
        engine = self.engine
        if isinstance(item, _Submit):
            rid = engine.submit(item.prompt, cache_salt=item.cache_salt)  # checked at submit: not again
            self._open[rid] = _Open(item.ticket, item.sink, len(item.prompt.ids))
            self._rid_of[item.ticket] = rid
        elif isinstance(item, _Abort):
            open_rid = self._rid_of.get(item.ticket)
            if open_rid is not None:
                self._end(engine.abort(open_rid, item.reason))
        else:
            try:
                item.future.set_result(item.fn(engine))
            except Exception as exc:
                item.future.set_exception(exc)

    def _flush(self, engine: Engine, host: bool) -> str | None:
        """On the engine thread: ``clear_cache`` if no request is open (one that was submitted before is in the
        engine already: the inbox is drained in order)."""
        if self._open or engine.has_work():
            return f"{len(self._open)} requests are running or waiting; flush once they ended (or abort them)"
        engine.clear_cache(host)
        return None

    def _end(self, out: Outcome | None) -> None:
        if out is None or out.rid not in self._open:
            return
        req = self._open.pop(out.rid)
        del self._rid_of[req.ticket]
        req.sink.on_finish(out)  # the engine's own outcome: its lists are its own, never touched again
        self._release()

    def _fail(self, rid: Hashable, reason: str) -> None:
        req = self._open.pop(rid)
        del self._rid_of[req.ticket]
        req.sink.on_finish(Outcome([], FinishReason.ERROR, reason, req.prompt_tokens, 0))
        self._release()

    def _release(self) -> None:
        with self._cond:
            self._open_count -= 1


def _engine_metrics(engine: Engine) -> dict[str, Any]:
    m = engine.metrics()
    m["engine_thread_cpu_s"] = time.thread_time()  # runs on the engine thread
    m["cached_states"] = engine.cache.num_checkpoints
    m["held_pages"] = m["live_pages"] - m["cached_pages"]
    m["held_slots"] = m["live_slots"] - m["cached_states"]
    return m
