"""Server-sent events: the chunk encoding and the streaming answer both generation endpoints give.

``EventStream`` writes straight to the ASGI ``send`` of the server (``hot.py`` serves these endpoints
below Starlette's middleware): the head, then one ``http.response.body`` write per wake-up of the loop
(every event it brought, encoded by the endpoint's ``encode``); the last write (ending with
``data: [DONE]``) is the response's end too. A ``direct`` generation's chunks, the last with ``[DONE]``, are
written by the backend's thread instead (``SocketWriter``, where uvicorn's connection allows it), so the loop
is woken only to end the response (uvicorn's ``send`` writes the chunked encoding's terminator); the CPU that
thread spends on them is counted (``ServerState.count_write``).
It follows the generation itself (``Generation.next``, no generator layers per chunk) while a watcher task
turns the client's disconnect into an abort at once (uvicorn drops writes to a closed connection), so a
gone client ends the stream promptly. uvicorn tells a disconnect only to the newest request of a
connection, so every wake-up also checks the connection (``connection_closed``): a pipelined request
whose client went away ends at its next token, not at its last, and nothing is written to the closed
transport.

Invariant: ``ServerState.release`` runs once the stream is over, however it ended (done, the client
gone, an error, the task cancelled, or the head never written), so the generation is never left open.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from starlette.types import Receive, Send

from hybridkv.server.generation import Generation, Update, Writer
from hybridkv.server.socket_writer import SocketWriter, connection_closed
from hybridkv.server.state import ServerState

DONE = b"data: [DONE]\n\n"
_HEAD = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
    ],
}
_encode = msgspec.json.encode


def sse(payload: dict[str, Any]) -> bytes:
    """One ``data: {json}`` event."""
    return b"data: " + _encode(payload) + b"\n\n"


Encode = Callable[[list[Update]], list[bytes]]
"""One wake-up's updates -> its events (``sse`` each)."""


async def _body(send: Send, body: bytes, more: bool) -> bool:
    """One body write through uvicorn's ``send`` (the caller checked the connection); False (nothing written) when
    it closed while ``send`` waited for the client to read."""
    try:
        await send({"type": "http.response.body", "body": body, "more_body": more})
    except RuntimeError:
        if connection_closed(send):
            return False
        raise
    return True


class EventStream:
    def __init__(self, state: ServerState, gen: Generation, ids: Sequence[str], receive: Receive, encode: Encode):
        self.state = state
        self.gen = gen
        self.ids = ids
        self.receive = receive
        self.encode = encode

    def _events(self, updates: list[Update]) -> list[bytes]:
        self.state.observe(self.gen, updates)
        return self.encode(updates)

    async def __call__(self, send: Send) -> None:
        state, gen = self.state, self.gen
        watcher = state.watch(self.receive, gen)
        writer = None
        try:
            await send(_HEAD)
            if gen.direct:
                writer = SocketWriter.attach(send)
                gen.attach(None if writer is None else self._writes_to(writer))
            while True:  # with a writer attached, ``next`` returns only once it is over
                updates = await gen.next()
                if writer is not None:  # what it spilled goes first (the loop writes after a spill)
                    writer.flush()
                if connection_closed(send):  # the client is gone (a pipelined request is not told): ``release`` it
                    return
                if gen.done and not updates:  # the backend's thread wrote the last events and [DONE]
                    assert writer is not None
                    await _body(send, b"", False)
                    return
                events = self._events(updates)
                if gen.done:  # the last events and the response's end: one write
                    events.append(DONE)
                    await _body(send, b"".join(events), False)
                    return
                if not await _body(send, b"".join(events), True):
                    return
        finally:
            if writer is not None:
                gen.detach()
                writer.close()
            watcher.cancel()
            state.release(gen, self.ids)

    def _writes_to(self, writer: SocketWriter) -> Writer:
        def write(updates: list[Update]) -> bool:  # in the backend's thread
            start = time.thread_time()
            events = self._events(updates)
            if self.gen.done:
                events.append(DONE)
            direct = writer.write(b"".join(events))
            self.state.count_write(time.thread_time() - start)
            return direct

        return write
