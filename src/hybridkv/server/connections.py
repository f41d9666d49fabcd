"""The limits a connection meets before any request on it reaches the app (so before the API key check).

uvicorn's httptools protocol reads a request's header block with no bound on its size or on the time it
takes: a client without a key could hold one header line open and make the server buffer it without end
(32 MiB in one test), or hold a connection open with nothing sent. ``GuardedHttpProtocol`` is that
protocol with three limits, each answered on the connection itself and counted in ``ConnectionCounters``:

- **Header size**: once the bytes received since a request began pass ``max_header_bytes`` and its
  headers are still incomplete, the answer is ``431`` and the connection closes (nothing more is read,
  so the memory a connection can pin is the limit plus one socket read).
- **Header time**: a connection whose request head is not complete ``header_timeout_s`` after the
  connection opened (or after its previous request's head began) gets ``408`` and is closed. An idle
  keep-alive connection between requests is closed by uvicorn's own keep-alive timeout.
- **Connections**: a connection beyond ``max_connections`` open at once gets ``503`` and is closed.

Invariants: every refusal closes the connection after its one answer; a counter counts each refusal
once; the limits apply to every path, ``/health`` included; answers are the server's usual JSON error.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from hybridkv.server.schemas import ApiError

KIB = 1 << 10


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int = 64 * KIB
    header_timeout_s: float = 15.0
    max_connections: int = 1024

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1 * KIB:
            raise ValueError(f"max_header_bytes must be at least 1 KiB, got {self.max_header_bytes}")
        if not 0 < self.header_timeout_s < float("inf"):
            raise ValueError(f"header_timeout_s must be a positive number of seconds, got {self.header_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


class ConnectionCounters:
    """Refusals at the connection level, by reason (any thread may read ``snapshot``)."""

    REASONS = ("header_too_large", "header_timeout", "too_many_connections")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.REASONS, 0)

    def count(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def _answer(exc: ApiError) -> bytes:
    """``exc`` as a whole HTTP/1.1 response that closes the connection."""
    body = msgspec.json.encode(exc.body())
    extra = "".join(f"{name.lower()}: {value}\r\n" for name, value in exc.headers.items())
    head = (
        f"HTTP/1.1 {exc.status} {HTTPStatus(exc.status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above; ``guarded_protocol`` binds the limits."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    counters: ClassVar[ConnectionCounters] = ConnectionCounters()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False  # a request's head has begun (or the connection opened) and is not complete
        self._head_bytes = 0  # bytes received since then
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            message = f"connections: more than the {self.limits.max_connections} this server holds open; retry later"
            self._refuse("too_many_connections", ApiError(503, message, None, {"Retry-After": "1"}))
            return
        self._begin_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_head()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                message = f"headers: larger than the {self.limits.max_header_bytes} bytes this server accepts"
                self._refuse("header_too_large", ApiError(431, message, "headers"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:
            self._begin_head()

    def on_headers_complete(self) -> None:
        self._end_head()
        super().on_headers_complete()

    def _begin_head(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _end_head(self) -> None:
        self._in_head = False
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self._in_head and not self.transport.is_closing():
            message = f"headers: not complete within {self.limits.header_timeout_s:g} s of the request's start"
            self._refuse("header_timeout", ApiError(408, message, "headers"))

    def _refuse(self, reason: str, exc: ApiError) -> None:
        self._end_head()
        self.counters.count(reason)
        self.transport.write(_answer(exc))
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits, counters: ConnectionCounters) -> type[GuardedHttpProtocol]:
    """A ``GuardedHttpProtocol`` class bound to ``limits`` and ``counters`` (uvicorn builds one per connection)."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits, "counters": counters})
