"""Server-sent events: the chunk encoding and the streaming response both endpoints answer with.

``EventStream`` is a plain ASGI response: the head, then one ``http.response.body`` write per chunk
the handler yields (a handler yields one chunk per wake-up: every event it brought); the last chunk
(ending with ``data: [DONE]``) is written together with the end of the response. It starts no task
of its own: the handler's generation is followed by ``ServerState.drive``, whose watcher already
turns a client's disconnect into an abort at once (and uvicorn drops writes to a closed
connection), so a gone client ends the stream promptly.

Invariant: ``on_close`` runs once the response is over, however it ended (done, the client gone, an
error, the task cancelled, or the chunks never started), so the generation is never left open.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # made once: json.dumps with options builds one per call


def sse(payload: dict[str, Any]) -> bytes:
    """One ``data: {json}`` event."""
    return b"data: " + _ENCODER.encode(payload).encode() + b"\n\n"


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[bytes, None], on_close: Callable[[], None]):
        self.chunks = chunks
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                last = chunk.endswith(DONE)  # the last chunk and the response's end: one write
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            try:
                await self.chunks.aclose()  # a stream left early: its generation's own cleanup runs now
            finally:
                self.on_close()
