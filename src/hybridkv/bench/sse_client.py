"""The load generator's HTTP client: streaming ``POST``s over keep-alive HTTP/1.1 connections, lean per chunk.

``bench serve`` measures the server's overhead per request on a machine whose cores the client shares with
the server, so whatever the client spends per streamed chunk lands in the figure. This client is an
``asyncio.Protocol`` per connection feeding ``httptools`` (the parser uvicorn serves with; no hand-written
HTTP parsing): each ``data_received`` goes straight to the parser, the body bytes are split into SSE
events and each event is handed to the caller with the ``perf_counter`` stamp of the read that brought
it (httpx spent about 2.5x the CPU per chunk: its stream, line and decoder layers; measured in
``bench serve`` as ``client_cpu_ms``).

Invariants:
- A connection carries one request at a time and goes back to the pool only after a complete response
  the server let it keep; a connection lost, a response cut short or a request over its timeout raises
  ``ServerError``/``TimeoutError`` and the connection is closed, never reused.
- A status other than 200 raises ``ServerError`` with the status and the start of the body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

EventSink = Callable[[bytes, float], None]
"""Gets each SSE event (its bytes, without the blank line ending it) and when it was read; an answer that is not
an event stream (a plain JSON body) comes as one event: the whole body, when its last byte was read."""


class ServerError(RuntimeError):
    """The server answered something other than a complete 200, or the connection broke."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self._sink: EventSink | None = None
        self._done: asyncio.Future[None] | None = None
        self._pending = b""  # body bytes after the last complete event
        self._error_body = bytearray()
        self._status = 0
        self._keep_alive = False

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ServerError(f"unparsable HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(ServerError(f"the server closed the connection mid-response ({exc or 'EOF'})"))

    # --- httptools callbacks ----------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._status = self.parser.get_status_code()
        self._keep_alive = self.parser.should_keep_alive()  # known here; not once the message is complete

    def on_body(self, body: bytes) -> None:
        if self._status != 200:
            self._error_body += body
            return
        at = time.perf_counter()
        *events, self._pending = (self._pending + body).split(b"\n\n")
        sink = self._sink
        assert sink is not None
        for event in events:
            sink(event, at)

    def on_message_complete(self) -> None:
        done = self._done
        if done is None or done.done():
            return
        if self._status == 200 and self._pending:  # a body that is not an event stream: one event
            assert self._sink is not None
            self._sink(self._pending, time.perf_counter())
            self._pending = b""
        if self._status != 200:
            text = self._error_body.decode(errors="replace")[:300]
            done.set_exception(ServerError(f"the server answered {self._status}: {text}"))
        else:
            done.set_result(None)

    # --- one request ------------------------------------------------------------------------

    async def request(self, head: bytes, body: bytes, sink: EventSink) -> bool:
        """Send one request, stream its answer to ``sink``; whether the connection may be reused."""
        assert self.transport is not None
        self._sink, self._pending, self._status = sink, b"", 0
        self._error_body.clear()
        self._done = asyncio.get_running_loop().create_future()
        if self.lost:
            raise ServerError("the server closed the connection")
        self.transport.write(head + body)
        await self._done
        return self._keep_alive and not self.lost

    def _fail(self, exc: Exception) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class SseClient:
    """Streaming POSTs to one server (``http://host:port``), one pooled connection per request in flight."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float = 600.0):
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"url: {url!r} is not http://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port
        self.timeout_s = timeout_s
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._headers = f"host: {self.host}:{self.port}\r\n{extra}".encode()
        self._idle: list[_Connection] = []

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost:
                return conn
        _, conn = await asyncio.get_running_loop().create_connection(_Connection, self.host, self.port)
        return conn

    async def connect(self, n: int) -> None:
        """Open ``n`` connections ahead (so no request pays for a connect)."""
        conns = [await self._connection() for _ in range(n)]
        self._idle.extend(conns)

    async def post(self, path: str, body: bytes, sink: EventSink) -> None:
        """``POST path`` with a JSON ``body``; every SSE event of the answer to ``sink``."""
        head = (
            f"POST {path} HTTP/1.1\r\n".encode()
            + self._headers
            + f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        )
        conn = await self._connection()
        try:
            keep = await asyncio.wait_for(conn.request(head, body, sink), self.timeout_s)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise
        if keep:
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
