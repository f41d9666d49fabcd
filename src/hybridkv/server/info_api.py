"""What a client asks about the server, and SGLang's cache flush: ``/server_info``, ``/get_model_info``,
``/v1/models[/{id}]``, ``/flush_cache``.

``GET /server_info`` (and its older name ``/get_server_info``) answers SGLang's shape: the options
the server was started with, the backend's sizing in SGLang's names (``page_size``,
``max_total_num_tokens``, ``max_running_requests``, ``chunked_prefill_size``, ...), ``model_path``,
``served_model_name``, ``context_length``, ``version``. ``GET /get_model_info``: ``model_path``,
``tokenizer_path``, ``is_generation`` (true), ``served_model_name``. ``GET /v1/models/{id}``: OpenAI's
model card of the served model, 404 naming any other. ``POST`` or ``GET /flush_cache``
(``?host=true``: host memory too) empties the prefix cache through the backend and answers as SGLang
does, ``Cache flushed.``; while requests are open it changes nothing and answers 400 saying why (503
once the backend no longer serves).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

import hybridkv
from hybridkv.server.backend import BackendClosed
from hybridkv.server.schemas import ApiError
from hybridkv.server.state import ServerState

FLAGS = {"true": True, "1": True, "false": False, "0": False}


def card(request: Request) -> dict[str, Any]:
    """The OpenAI model card of the served model."""
    info = request.app.state.server.info
    return {
        "id": info.name,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "hybridkv",
        "root": _model_path(request.app.state.server),
        "max_model_len": info.max_context,
    }


def _model_path(state: ServerState) -> str:
    return state.config.model_path or state.info.name


async def model_card(request: Request) -> Response:
    state: ServerState = request.app.state.server
    state.check_model(request.path_params["model_id"])
    return JSONResponse(card(request))


async def model_info(request: Request) -> Response:
    state: ServerState = request.app.state.server
    tokenizer = state.config.tokenizer
    return JSONResponse(
        {
            "model_path": _model_path(state),
            "tokenizer_path": None if tokenizer is None else tokenizer.source,
            "is_generation": True,
            "served_model_name": state.info.name,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }
    )


async def server_info(request: Request) -> Response:
    state: ServerState = request.app.state.server
    info = state.info
    sizing = await asyncio.to_thread(state.backend.describe)
    tokenizer = state.config.tokenizer
    return JSONResponse(
        {
            **state.config.server_args,
            "model_path": _model_path(state),
            "tokenizer_path": None if tokenizer is None else tokenizer.source,
            "served_model_name": info.name,
            "context_length": info.max_context,
            "max_req_input_len": info.max_context - 1,
            "vocab_size": info.vocab_size,
            "mem_fraction_static": None,
            "gpu_memory": info.memory_budget,
            "stream_interval": state.config.stream_interval,
            **sizing,
            "version": hybridkv.__version__,
        }
    )


async def flush_cache(request: Request) -> Response:
    state: ServerState = request.app.state.server
    given = request.query_params.get("host", "false")
    host = FLAGS.get(given.lower())
    if host is None:
        raise ApiError(400, f"host: {given!r} is not a flag; give true or false", "host")
    try:
        why = await asyncio.to_thread(state.backend.flush_cache, host)
    except BackendClosed as exc:
        raise ApiError(503, f"not serving: {exc}", None, {"Retry-After": "5"}) from None
    if why is not None:
        raise ApiError(400, f"cache not flushed: {why}")
    return PlainTextResponse("Cache flushed.\n")
