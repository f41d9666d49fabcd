"""hybridkv.server: the HTTP front end over one engine or a disaggregated PD server.

``EngineBackend(engine, name, memory_budget)`` owns a single-process ``Engine`` in a background
thread; ``PDBackend(pd_server, name, memory_budget)`` serves through a ``PDServer`` (its router
thread, prefill and decode worker processes). ``create_app(ServerState(backend, ServerConfig(...)))``
is the ASGI app (SGLang-native ``/generate``, OpenAI ``/v1/completions``, ``/v1/models``,
``/health``, ``/metrics``, ``/abort_request``, ``/flush_cache``, ``/server_info``, ``/get_model_info``);
``serve(backend, config, bind(host, port), shutdown_timeout)`` runs it on uvicorn until SIGTERM,
and ``HttpServer`` runs it from a thread. Depends on ``hybridkv.engine`` only; nothing below imports it.
"""

from hybridkv.server.app import create_app
from hybridkv.server.backend import Backend, BackendClosed, ModelInfo, QueueFull, Sink
from hybridkv.server.engine_backend import EngineBackend
from hybridkv.server.pd_backend import PDBackend
from hybridkv.server.run import HttpServer, bind, serve
from hybridkv.server.state import ServerConfig, ServerState
from hybridkv.server.text import ByteTokenizer, Tokenizer, has_tokenizer

__all__ = [
    "Backend",
    "BackendClosed",
    "ByteTokenizer",
    "EngineBackend",
    "HttpServer",
    "ModelInfo",
    "PDBackend",
    "QueueFull",
    "ServerConfig",
    "ServerState",
    "Sink",
    "Tokenizer",
    "bind",
    "create_app",
    "has_tokenizer",
    "serve",
]
