"""The gate every HTTP request passes first (plain ASGI, no buffering): API key and body size.

Invariants:
- With an API key set, every path but ``/health`` answers 401 unless the request carries
  ``Authorization: Bearer <key>`` (compared in constant time); the body is never read before.
  A request with more than one ``Authorization`` header answers 400 on every path (which one a
  proxy or this server would read is not defined, so none is).
- A body over ``max_body_bytes`` answers 413: at once when ``Content-Length`` says so, else when the
  bytes read pass the limit (``BodyTooLarge`` out of ``receive``, turned into a 413 by the app).
"""

from __future__ import annotations

import hmac
from typing import Any

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridkv.server.schemas import ApiError

OPEN_PATHS = frozenset({"/health"})


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"body: larger than the {limit} bytes this server accepts")
        self.limit = limit


async def send_error(send: Send, exc: ApiError) -> None:
    """``exc`` as the answer (its status, headers and ``{"error": ...}`` body)."""
    body = msgspec.json.encode(exc.body())
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _count(headers: list[tuple[bytes, bytes]], name: bytes) -> int:
    return sum(1 for key, _ in headers if key == name)


class Edge:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.key = None if not api_key else f"Bearer {api_key}".encode()
        self.max_body = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if len(headers) != len(scope["headers"]) and _count(scope["headers"], b"authorization") > 1:
            message = "authorization: more than one Authorization header; send exactly one"
            await send_error(send, ApiError(400, message, "authorization"))
            return
        if self.key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                why = "missing" if not given else "wrong"
                message = f"authorization: {why} API key; send the header 'Authorization: Bearer <key>'"
                await send_error(send, ApiError(401, message, "authorization", {"WWW-Authenticate": "Bearer"}))
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await send_error(send, ApiError(413, str(BodyTooLarge(self.max_body)), "body"))
            return
        await self.app(scope, self._limited(receive), send)

    def _limited(self, receive: Receive) -> Receive:
        seen = 0
        limit = self.max_body

        async def limited() -> Message:
            nonlocal seen
            message: Any = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return limited
