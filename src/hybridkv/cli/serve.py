"""``hybridkv serve``: the HTTP server (``hybridkv.server``) over one engine, until SIGTERM.

Refused before anything listens, one ``error:`` line, exit 2: not exactly one of ``--model`` and
``--random``, a model the engine cannot load or a budget below one request's floor, bad option
values (typer ``min=``, ``cli/params.py``), a ``--tokenizer`` directory without a tokenizer, a port
that cannot be bound, and ``--disaggregated`` (its backend is not wired into the server yet).
Prints ``hybridkv serve: listening on http://HOST:PORT ...`` once it accepts connections; exits 0
after a graceful shutdown (SIGTERM or SIGINT).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from hybridkv.cli.app import app
from hybridkv.cli.params import CHECKPOINTS_HELP, byte_size, engine_checkpoints, positive_finite, random_model
from hybridkv.engine.random_models import tiny_names

if TYPE_CHECKING:
    from hybridkv.engine.engine import Engine

API_KEY_ENV = "HYBRIDKV_API_KEY"


@app.command()
def serve(
    model: Path = typer.Option(
        None, "--model", exists=True, file_okay=False, help="Directory with config.json + *.safetensors."
    ),
    random: str = typer.Option(
        None, "--random", callback=random_model, help=f"A tiny random model: {', '.join(tiny_names())}."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (only this one)."),
    port: int = typer.Option(30000, "--port", min=0, max=65535, help="Port (0: any free port, printed)."),
    api_key: str = typer.Option(
        None, "--api-key", help=f"Require 'Authorization: Bearer KEY' on all but /health (or set ${API_KEY_ENV})."
    ),
    tokenizer: Path = typer.Option(
        None, "--tokenizer", exists=True, file_okay=False, help="A saved tokenizer: accept text prompts."
    ),
    gpu_memory: str = typer.Option("256MiB", "--gpu-memory", callback=byte_size, help="Memory budget (K/V + state)."),
    page_size: int = typer.Option(16, "--page-size", min=1),
    chunk_size: int = typer.Option(64, "--chunk-size", min=1, help="Prefill chunk, in tokens."),
    max_running: int = typer.Option(64, "--max-running", min=1, help="Requests in one batch, at most."),
    max_context: int = typer.Option(None, "--max-context", min=2, help="Prompt + new tokens (default: the model's)."),
    max_queued: int = typer.Option(256, "--max-queued", min=0, help="Requests waiting beyond --max-running; 503."),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Compute every prompt in full."),
    checkpoints: str | None = typer.Option(None, "--checkpoints", help=CHECKPOINTS_HELP),
    max_body: str = typer.Option("16MiB", "--max-body", callback=byte_size, help="Largest request body (413)."),
    shutdown_timeout: float = typer.Option(
        30.0, "--shutdown-timeout", callback=positive_finite, help="Seconds in-flight requests get on SIGTERM."
    ),
    disaggregated: bool = typer.Option(False, "--disaggregated", help="Serve through the PD server."),
    prefill_pp: int = typer.Option(2, "--prefill-pp", min=1, help="Prefill pipeline stages (--disaggregated)."),
    prefill_tp: int = typer.Option(1, "--prefill-tp", min=1, help="Prefill TP ranks per stage (--disaggregated)."),
    decode_tp: int = typer.Option(2, "--decode-tp", min=1, help="Decode TP ranks (--disaggregated)."),
    transport: str = typer.Option("shm", "--transport", help="shm or mooncake (--disaggregated)."),
) -> int:
    """Serve over HTTP: SGLang /generate, OpenAI /v1/completions, /metrics; SIGTERM shuts down gracefully."""
    from hybridkv.memory import parse_bytes
    from hybridkv.server import EngineBackend, ServerConfig, Tokenizer
    from hybridkv.server import serve as run_server

    if (model is None) == (random is None):
        raise typer.BadParameter("give exactly one of --model DIR and --random NAME", param_hint="--model/--random")
    if disaggregated:
        raise typer.BadParameter(
            "the disaggregated backend is not wired into the HTTP server yet; serve without --disaggregated "
            "(or use `hybridkv serve-pd` for a prompts file)",
            param_hint="--disaggregated",
        )
    key = api_key or os.environ.get(API_KEY_ENV) or None
    config = ServerConfig(
        api_key=key,
        max_body_bytes=parse_bytes(max_body),
        tokenizer=None if tokenizer is None else Tokenizer(tokenizer),
    )
    engine = build_engine(
        model, random, gpu_memory, page_size, chunk_size, max_running, max_context, not no_prefix_cache, checkpoints
    )
    name = random if random is not None else Path(model).name
    backend = EngineBackend(engine, name, gpu_memory, max_queued)
    return run_server(backend, config, host, port, shutdown_timeout)


def build_engine(
    model: Path | None,
    random: str | None,
    gpu_memory: str,
    page_size: int,
    chunk_size: int,
    max_running: int,
    max_context: int | None,
    prefix_cache: bool,
    checkpoints: str | None,
) -> Engine:
    from hybridkv.engine.engine import Engine  # lazily: the engine pulls in transformers

    if random is None:
        source, weights = model, None
    else:
        from hybridkv.engine.random_models import build_random

        weights, source = build_random(random)
    return Engine(
        source,
        weights,
        gpu_memory=gpu_memory,
        page_size=page_size,
        chunk_size=chunk_size,
        max_running=max_running,
        max_context=max_context,
        prefix_cache=prefix_cache,
        checkpoints=engine_checkpoints(checkpoints, chunk_size, page_size),
    )
