"""The ASGI app: routes, the error answers, and the edge gate in front of them.

Routes: ``POST /generate`` and ``POST /abort_request`` (SGLang-native, ``sglang_api``),
``POST /v1/completions`` (OpenAI, ``openai_api``), ``POST /v1/chat/completions`` (``chat_api``)
(the generation endpoints, served below Starlette,
``hot``), ``GET /v1/models`` and ``GET /v1/models/{id}``, ``GET /server_info`` (``/get_server_info``),
``GET /get_model_info``, ``POST``/``GET /flush_cache`` (``info_api``), ``GET /health`` (200 while
the backend serves, else 503 naming why; open without an API key), ``GET /metrics`` (Prometheus
text, ``metrics``).

Invariant: every answer other than 200 is ``{"error": {"message", "type", "param", "code"}}``:
400 naming the field, 401 without the key, 404 for an unknown path or model, 405, 413 for an
oversized body, 503 with ``Retry-After`` when full or not serving, and 500 for anything
unexpected: its traceback goes to the server log, the client gets the exception's type only.
"""

from __future__ import annotations

import asyncio
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from hybridkv.server.chat_api import chat_completions
from hybridkv.server.edge import BodyTooLarge, Edge
from hybridkv.server.hot import HotPaths, internal_error
from hybridkv.server.info_api import card, flush_cache, model_card, model_info, server_info
from hybridkv.server.openai_api import completions
from hybridkv.server.schemas import ApiError
from hybridkv.server.sglang_api import abort_request, generate
from hybridkv.server.state import ServerState

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    why = state.backend.health()
    if why is not None:
        return JSONResponse({"status": "unavailable", "reason": why}, 503)
    return JSONResponse({"status": "ok", "model": state.info.name})


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [card(request)]})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    state.in_loop()
    return Response(await asyncio.to_thread(state.metrics.render), media_type=PROMETHEUS_TEXT)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error(exc)


async def _too_large(request: Request, exc: Exception) -> Response:
    return _error(ApiError(413, str(exc), "body"))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    return _error(ApiError(exc.status_code, f"{where}: {exc.detail}", None, dict(exc.headers or {})))


async def _internal(request: Request, exc: Exception) -> Response:
    return _error(internal_error(exc, request.url.path))


def create_app(state: ServerState) -> ASGIApp:
    """The app serving ``state.backend`` (which the caller owns and closes), behind the edge gate."""
    config = state.config
    routes = [
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_card, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            ApiError: _api_error,
            BodyTooLarge: _too_large,
            HTTPException: _http_error,
            Exception: _internal,
        },
    )
    app.state.server = state
    app.state.started = int(time.time())
    hot = HotPaths(
        app, state, {"/generate": generate, "/v1/completions": completions, "/v1/chat/completions": chat_completions}
    )
    return Edge(hot, config.api_key, config.max_body_bytes)
