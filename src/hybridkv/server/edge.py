"""The gate every HTTP request passes first (plain ASGI, no buffering): API key and body size.

Invariants:
- With an API key set, every path but ``/health`` answers 401 unless the request carries
  ``Authorization: Bearer <key>`` (compared in constant time); the body is never read before.
- A body over ``max_body_bytes`` answers 413: at once when ``Content-Length`` says so, else when the
  bytes read pass the limit (``BodyTooLarge`` out of ``receive``, turned into a 413 by the app).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"body: larger than the {limit} bytes this server accepts")
        self.limit = limit


async def send_error(send: Send, status: int, message: str, param: str | None, headers: dict[str, str]) -> None:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


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
        if self.key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                why = "missing" if not given else "wrong"
                await send_error(
                    send,
                    401,
                    f"authorization: {why} API key; send the header 'Authorization: Bearer <key>'",
                    "authorization",
                    {"WWW-Authenticate": "Bearer"},
                )
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await send_error(send, 413, str(BodyTooLarge(self.max_body)), "body", {})
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
