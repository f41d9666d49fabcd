"""The generation endpoints (``POST /generate``, ``POST /v1/completions``) served as plain ASGI, below Starlette.

Every streamed chunk of these two paths costs the event loop, which shares the GIL with the engine
thread, so a chunk of work on the loop is a chunk of delay in the engine's step. Starlette's middleware
stack wraps ``send`` twice per chunk and builds a request, a route match and exception-handler layers
per request; here a handler gets the server state, the body and ``receive``, and answers a callable
(``Json``, or ``sse.EventStream``) that writes to uvicorn's ``send`` directly. Every other path goes on
to the Starlette app.

Invariant: these paths answer exactly as the Starlette app does (``app.py``): 405 with ``Allow: POST``
for another method, every refusal ``{"error": {...}}`` (``ApiError``, 413 for a body over the limit the
edge enforces), and an unexpected exception a 500 naming only its type, its traceback in the server
log; a client gone before its body arrived is answered nothing.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from hybridkv.server.edge import BodyTooLarge, send_error
from hybridkv.server.schemas import ApiError
from hybridkv.server.socket_writer import connection_closed
from hybridkv.server.state import ServerState

Answer = Callable[[Send], Awaitable[None]]
Handler = Callable[[ServerState, bytes, Receive], Awaitable[Answer]]


class Json:
    """A 200 answer with a JSON body."""

    def __init__(self, payload: Any):
        self.payload = payload

    async def __call__(self, send: Send) -> None:
        if connection_closed(send):  # a pipelined request whose client went away: nobody to answer
            return
        body = msgspec.json.encode(self.payload)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def internal_error(exc: BaseException, path: str) -> ApiError:
    """The 500 for an unexpected exception (its traceback goes to the server log, not to the client)."""
    traceback.print_exception(exc, file=sys.stderr)
    message = f"internal error ({type(exc).__name__}) serving {path}; the server log has the details"
    return ApiError(500, message)


class _Gone(Exception):
    """The client disconnected before its whole body arrived."""


async def _body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Gone
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


class HotPaths:
    def __init__(self, app: ASGIApp, state: ServerState, routes: dict[str, Handler]):
        """``routes``: path -> handler of its ``POST``; ``app`` serves every other path."""
        self.app = app
        self.state = state
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        try:
            if scope["method"] != "POST":
                where = f"{scope['method']} {scope['path']}"
                raise ApiError(405, f"{where}: Method Not Allowed", None, {"Allow": "POST"})
            answer = await handler(self.state, await _body(receive), receive)
        except _Gone:
            return
        except ApiError as exc:
            await send_error(send, exc)
            return
        except BodyTooLarge as exc:
            await send_error(send, ApiError(413, str(exc), "body"))
            return
        except Exception as exc:
            await send_error(send, internal_error(exc, scope["path"]))
            return
        await answer(send)
