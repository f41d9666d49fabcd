"""What every endpoint shares: the backend, the config, the metrics, and the open requests by id.

``ServerState.start`` is the one way a handler turns validated prompts into a running
``Generation`` (refusals become ``ApiError``: 400 naming the field, 503 with ``Retry-After`` for a
full queue or a closing backend); ``ServerState.drive`` is the one way it follows one to its end
while watching the client, so every endpoint aborts on disconnect and accounts its latencies alike.

Invariants:
- An id is registered (``/abort_request`` finds it) from ``start`` until the generation ended or
  its handler left; ids of open requests are unique.
- A handler that leaves before its generation ended (client gone, error, cancellation) aborts
  it: the backend releases every page and slot it held.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Receive

from hybridkv.engine.sched.request import SamplingParams
from hybridkv.server.backend import Backend, BackendClosed, QueueFull
from hybridkv.server.connections import ConnectionCounters, ConnectionLimits
from hybridkv.server.generation import Generation, LoopPost, PromptRefused, Update
from hybridkv.server.metrics import ServerMetrics
from hybridkv.server.schemas import ApiError, named
from hybridkv.server.stops import Stops
from hybridkv.server.text import TextTokenizer

MIB = 1 << 20
IGNORED_NAMES = 64
"""Distinct ignored field names the server logs and counts by name; beyond them (a client sending made-up names)
they count as ``OTHER_FIELD``, so neither the log nor ``/metrics`` grows without bound."""
OTHER_FIELD = "(other)"
MAX_NAME = 100  # a longer ignored name counts as OTHER_FIELD too


@dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None
    max_body_bytes: int = 16 * MIB
    tokenizer: TextTokenizer | None = None
    stream_interval: int = 1  # tokens per streamed chunk (a prompt's first token and its end go at once)
    direct_writes: bool = True  # the backend's thread writes a stream's chunks (``SocketWriter``), not the loop
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)  # header size, time; connections
    model_path: str | None = None  # what the model was loaded from (``/get_model_info``; None: the served name)
    model_aliases: frozenset[str] = frozenset()
    """Other names a request's ``model`` may give the served model, normalised (``os.path.normpath``): the
    ``--model`` directory as given and as an absolute path, what SGLang's and vLLM's clients send when they were
    started with ``--model PATH``."""
    server_args: Mapping[str, Any] = field(default_factory=dict)  # the options it was started with (``/server_info``)

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 token per streamed chunk, got {self.stream_interval}")


class ServerState:
    def __init__(self, backend: Backend, config: ServerConfig):
        self.backend = backend
        self.config = config
        self.info = backend.info
        self.metrics = ServerMetrics(self._figures)
        self.connections = ConnectionCounters()  # refusals before a request reaches the app
        self.open: dict[str, tuple[Generation, list[int]]] = {}
        self._post: LoopPost | None = None  # the serving loop's (made on the first request, in it)
        self._loop_clock: int | None = None  # the CPU clock of the thread serving HTTP (``in_loop``)
        self._write_lock = threading.Lock()
        self._write_cpu_s = 0.0  # CPU the backend's thread spent writing streamed chunks (under _write_lock)
        self._ignored: set[str] = set()  # field names ignored so far (logged once each; the loop only)

    def in_loop(self) -> None:
        """Called on the serving loop's thread (every request that reaches the backend, every scrape):
        from then on ``/metrics`` counts that thread's CPU."""
        if self._loop_clock is None:
            self._loop_clock = time.pthread_getcpuclockid(threading.get_ident())

    def _figures(self) -> dict[str, Any]:
        figures = self.backend.metrics()
        if self._loop_clock is not None:
            figures["http_loop_cpu_s"] = time.clock_gettime(self._loop_clock)
        with self._write_lock:
            figures["stream_write_cpu_s"] = self._write_cpu_s
        figures["connections_refused"] = self.connections.snapshot()
        return figures

    def check_model(self, wanted: str | None) -> None:
        """A request's ``model`` (None: not given) names the served model by its name or an alias (a path compared
        as text once normalised, ``./tiny/`` as ``tiny``: nothing is looked up on disk), else 404."""
        aliases = self.config.model_aliases
        if wanted is not None and wanted != self.info.name and os.path.normpath(wanted) not in aliases:
            raise ApiError(404, f"model: {wanted!r} is not served here; this server serves {self.info.name!r}", "model")

    def ignore(self, endpoint: str, names: list[str]) -> None:
        """In the loop: the request to ``endpoint`` carried the fields ``names`` that no model knows: each name is
        logged the first time it is seen and counted (``hybridkv_ignored_request_fields_total``)."""
        for name in names:
            if name not in self._ignored and len(name) <= MAX_NAME and len(self._ignored) < IGNORED_NAMES:
                self._ignored.add(name)
                print(
                    f"hybridkv serve: ignoring the request field {name!r} (first sent to {endpoint}; this server does "
                    "not know it; logged once per name, counted in hybridkv_ignored_request_fields_total)",
                    file=sys.stderr,
                    flush=True,
                )
            label = name if name in self._ignored else OTHER_FIELD
            self.metrics.ignored_fields.labels(endpoint, label).inc()

    def count_write(self, cpu_s: float) -> None:
        """Any thread: CPU seconds spent writing one streamed chunk outside the loop (``SocketWriter``)."""
        with self._write_lock:
            self._write_cpu_s += cpu_s

    async def connect_loop(self) -> None:
        """In the serving loop, before the first request: its ``LoopPost``, connected (pipe wake-ups)."""
        self._post = LoopPost(asyncio.get_running_loop())
        await self._post.connect()

    def close_loop(self) -> None:
        """In the serving loop, once it serves no more: the ``LoopPost``'s pipe closed."""
        if self._post is not None:
            self._post.close()

    def new_id(self, prefix: str = "") -> str:
        return prefix + uuid.uuid4().hex

    def start(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        cache_salt: str | None,
        ids: dict[str, list[int]],
        fields: dict[str, str],
        batch: bool,
        stream: bool,
        stops: Sequence[Stops | None] = (),
    ) -> Generation:
        """Submit ``prompts`` as one generation registered under ``ids`` (id -> prompt indices); ``stream``:
        the handler wants each token as it comes; ``stops``: each prompt's stop strings (``stop_strings``)."""
        taken = [i for i in ids if i in self.open]
        if taken:
            raise ApiError(400, f"rid: {taken[0]!r} is the id of an open request; give another", "rid")
        self.in_loop()
        loop = asyncio.get_running_loop()
        if self._post is None or self._post.loop is not loop:  # not ``connect_loop``ed on this loop
            self._post = LoopPost(loop)
        config = self.config
        direct = stream and config.direct_writes
        gen = Generation(
            self.backend, self._post, prompts, stream, config.stream_interval, direct, config.tokenizer, stops
        )
        try:
            gen.start(params, cache_salt)
        except PromptRefused as exc:
            raise named(exc.error, fields, exc.index if batch else None) from None
        except QueueFull as exc:
            raise ApiError(503, str(exc), None, {"Retry-After": str(exc.retry_after_s)}) from None
        except BackendClosed as exc:
            raise ApiError(503, f"not serving: {exc}", None, {"Retry-After": "5"}) from None
        for rid, indices in ids.items():
            self.open[rid] = (gen, indices)
        return gen

    async def drive(self, receive: Receive, gen: Generation, ids: Sequence[str]) -> AsyncIterator[list[Update]]:
        """``gen``'s updates until it ended; aborts it when the client disconnects or the caller leaves early."""
        watcher = self.watch(receive, gen)
        try:
            async for updates in gen.updates():
                self.observe(gen, updates)
                yield updates
        finally:
            watcher.cancel()
            self.release(gen, ids)

    def watch(self, receive: Receive, gen: Generation) -> asyncio.Task[None]:
        """A task aborting ``gen`` once the client disconnects (the caller cancels it when done)."""
        return asyncio.ensure_future(_abort_on_disconnect(receive, gen))

    def observe(self, gen: Generation, updates: list[Update]) -> None:
        """The latency histograms take every prompt that ended in ``updates``."""
        for up in updates:
            if up.finished is not None:
                p = gen.progress[up.index]
                assert p.finished_at is not None
                self.metrics.observe(
                    gen.arrived, p.first_at, p.last_at, len(p.tokens), p.finished_at, up.finished.finish_reason
                )

    def release(self, gen: Generation, ids: Sequence[str]) -> None:
        """``gen``'s handler is done with it: abort it if it is still open, unregister ``ids``."""
        if not gen.done:
            gen.abort("the client went away")
        for rid in ids:
            self.open.pop(rid, None)

    def abort_all(self, reason: str) -> list[str]:
        """Abort every open request; their ids."""
        ids = list(self.open)
        for gen in {id(g): g for g, _ in self.open.values()}.values():
            gen.abort(reason)
        return ids

    def abort(self, rid: str) -> bool:
        """Abort the open request ``rid`` (all its prompts, or the one it names in a batch)."""
        got = self.open.get(rid)
        if got is None:
            return False
        gen, indices = got
        for i in indices:
            if i < len(gen.tickets) and gen.progress[i].finished is None:
                self.backend.abort(gen.tickets[i], "aborted by /abort_request")
        return True


async def _abort_on_disconnect(receive: Receive, gen: Generation) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gen.abort("the client disconnected")
            return
