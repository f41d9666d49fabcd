"""``hybridkv serve``: the HTTP server (``hybridkv.server``) over one engine, until SIGTERM; and
``hybridkv bench serve``: load on it next to the engine driven directly (``hybridkv.bench.serve``).

``--disaggregated`` serves through the PD server (``hybridkv.engine.disagg.PDServer``: a prefill
engine of ``--prefill-pp`` x ``--prefill-tp`` processes hands KV and state over ``--transport`` to
a decode engine of ``--decode-tp`` processes); ``--random`` saves the tiny model to a temporary
directory that lives as long as the server. Text: ``--tokenizer DIR``, else the ``--model`` directory's
own tokenizer (``tokenizer.json`` / ``tokenizer_config.json``), else for ``--random`` the built-in byte
tokenizer (``hybridkv.server.text.ByteTokenizer``). ``--fault KIND:REQUEST[:RANK[:DELAY]]`` (hidden; for
demos and tests) puts a deliberate fault on the request submitted ``REQUEST``-th (0-based):
a drill named in ``engine.disagg.faults.FAULTS``.

Sizing (``cli/sizing.py``, the same for every command): ``--gpu-memory`` (per process), ``--max-context``
(default: 4096 tokens, never above the model's maximum; the work is not known in advance),
``--page-size``, ``--chunk-size``; the default budget is what one request of that context needs on
every process (at least 256 MiB). Printed as one line on stderr before the server listens.

Refused before anything listens, one ``error:`` line, exit 2: not exactly one of ``--model`` and
``--random``, a model the engine cannot load, a ``--max-context`` above the model's maximum or a
``--gpu-memory`` below one request's floor or above what the host holds, bad option
values (typer ``min=``, ``cli/params.py``), a ``--tokenizer`` directory (or a ``--model`` directory's own
tokenizer files) without a loadable tokenizer, a port
that cannot be bound, a PD option without ``--disaggregated``, a layout the model cannot be split
into (``check_layout``), a bad ``--fault``, a ``--store-master`` no master answers at, and tier options
(``--host-memory``, ``--store``) with ``--no-prefix-cache``. With ``--disaggregated`` the tiers sit below
every prefill rank (``--host-memory`` and ``--store-memory`` per rank, one master for all). Prints
``hybridkv serve: listening on http://HOST:PORT ...`` once it accepts connections; exits 0 after a
graceful shutdown (SIGTERM or SIGINT), with every worker process reaped and every shared-memory file
unlinked.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from hybridkv.cli.app import app, bench_app
from hybridkv.cli.params import (
    CHECKPOINTS_HELP,
    DTYPE,
    HOST_MEMORY,
    MAX_RUNNING,
    MAX_STEP_TOKENS,
    STORE,
    STORE_MASTER,
    STORE_MEMORY,
    TRANSPORT_CHOICES,
    byte_size,
    engine_checkpoints,
    positive_finite,
    random_model,
    tier_options,
    transport_option,
)
from hybridkv.cli.sizing import (
    CHUNK,
    CHUNK_SIZE,
    GPU_MEMORY,
    MAX_CONTEXT,
    PAGE,
    PAGE_SIZE,
    SERVE_CHUNK_SIZE,
    SERVE_STEP_TOKENS,
    Layout,
    Sizing,
    size,
)
from hybridkv.engine.random_models import MAX_WIDEN, tiny_names
from hybridkv.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from hybridkv.engine.config import EngineConfig
    from hybridkv.engine.disagg import Fault
    from hybridkv.engine.engine import Engine
    from hybridkv.server import PDBackend
    from hybridkv.server.connections import ConnectionLimits
    from hybridkv.server.text import TextTokenizer
    from hybridkv.spec import ModelSpec

API_KEY_ENV = "HYBRIDKV_API_KEY"
PEERS = ("vllm",)  # servers ``bench serve --peer`` runs against (``hybridkv.bench.vs_peer``)
PEER_PAGE_SIZE = 32
"""``bench serve --peer``'s page size: vLLM's CPU attention takes multiples of 32 on a CPU without AMX (16 only with
it), so 32 starts on both."""
BENCH_PAGE_SIZE = typer.Option(
    None, "--page-size", min=1, help=f"Tokens per KV page (default: {PAGE}; {PEER_PAGE_SIZE} with --peer)."
)


def _transport(value: str | None) -> str | None:
    return None if value is None else transport_option(value)


def connection_limits(max_header: str, header_timeout: float, max_connections: int) -> ConnectionLimits:
    """The server's limits per connection (``--max-header``, ``--header-timeout``, ``--max-connections``)."""
    from hybridkv.server.connections import ConnectionLimits

    try:
        return ConnectionLimits(parse_bytes(max_header), header_timeout, max_connections)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-header") from None


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
        None,
        "--tokenizer",
        exists=True,
        file_okay=False,
        help="A saved tokenizer (default: the --model directory's own; --random: bytes): text prompts and outputs.",
    ),
    gpu_memory: str | None = GPU_MEMORY,
    max_context: int | None = MAX_CONTEXT,
    page_size: int = PAGE_SIZE,
    chunk_size: int | None = SERVE_CHUNK_SIZE,
    max_running: int = MAX_RUNNING,
    max_step_tokens: int | None = typer.Option(
        None,
        "--max-step-tokens",
        min=1,
        help=f"Prompt tokens one engine step computes, at most, its decodes on top (default: {SERVE_STEP_TOKENS} or "
        "--chunk-size if larger; "
        "16 x --chunk-size with --disaggregated).",
    ),
    max_queued: int = typer.Option(256, "--max-queued", min=0, help="Requests waiting beyond --max-running; 503."),
    gather_ms: float = typer.Option(
        None,
        "--gather-ms",
        min=0.0,
        max=50.0,
        help="An idle engine waits this long for each next request of a burst before its first step, 50 ms in all "
        "at most (default 0: it steps at once; for clients that send batches at once; one process only).",
    ),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Compute every prompt in full."),
    checkpoints: str | None = typer.Option(None, "--checkpoints", help=CHECKPOINTS_HELP),
    host_memory: str | None = HOST_MEMORY,
    store: str = STORE,
    store_master: str | None = STORE_MASTER,
    store_memory: str = STORE_MEMORY,
    dtype: str = DTYPE,
    max_body: str = typer.Option("16MiB", "--max-body", callback=byte_size, help="Largest request body (413)."),
    max_header: str = typer.Option(
        "64KiB", "--max-header", callback=byte_size, help="Largest request header block, before the key (431)."
    ),
    header_timeout: float = typer.Option(
        15.0, "--header-timeout", callback=positive_finite, help="Seconds a request's headers may take (408)."
    ),
    max_connections: int = typer.Option(
        1024, "--max-connections", min=1, help="Connections open at once; one more gets 503 and is closed."
    ),
    stream_interval: int = typer.Option(
        1, "--stream-interval", min=1, help="Tokens per streamed chunk; a prompt's first token and its end go at once."
    ),
    loop_writes: bool = typer.Option(
        False, "--loop-writes", help="The event loop writes every streamed chunk (default: the engine's thread does)."
    ),
    shutdown_timeout: float = typer.Option(
        30.0, "--shutdown-timeout", callback=positive_finite, help="Seconds in-flight requests get on SIGTERM."
    ),
    no_warmup: bool = typer.Option(
        False, "--no-warmup", help="Listen at once (default: a few requests warm the step shapes up; off with --fault)."
    ),
    disaggregated: bool = typer.Option(False, "--disaggregated", help="Serve through the PD server."),
    prefill_pp: int = typer.Option(None, "--prefill-pp", min=1, help="Prefill pipeline stages (PD; default 2)."),
    prefill_tp: int = typer.Option(None, "--prefill-tp", min=1, help="Prefill TP ranks per stage (PD; default 1)."),
    decode_tp: int = typer.Option(None, "--decode-tp", min=1, help="Decode TP ranks (PD; default 2)."),
    transport: str = typer.Option(
        None, "--transport", callback=_transport, help=f"KV/state transport: {TRANSPORT_CHOICES} (PD; default shm)."
    ),
    transfer_timeout: float = typer.Option(
        None, "--transfer-timeout", callback=positive_finite, help="PD: seconds for a request's KV to land (30)."
    ),
    fault: list[str] = typer.Option(
        None, "--fault", hidden=True, help="PD: KIND:REQUEST[:RANK[:DELAY]], a deliberate fault (demos, tests)."
    ),
) -> int:
    """Serve over HTTP: SGLang /generate, OpenAI /v1/completions, /metrics; SIGTERM shuts down gracefully."""
    import torch

    from hybridkv.server import Backend, EngineBackend, ServerConfig, bind
    from hybridkv.server import serve as run_server

    if (model is None) == (random is None):
        raise typer.BadParameter("give exactly one of --model DIR and --random NAME", param_hint="--model/--random")
    pd_given = {
        "--prefill-pp": prefill_pp,
        "--prefill-tp": prefill_tp,
        "--decode-tp": decode_tp,
        "--transport": transport,
        "--transfer-timeout": transfer_timeout,
        "--fault": fault or None,
    }
    stray = [name for name, value in pd_given.items() if value is not None]
    if stray and not disaggregated:
        raise typer.BadParameter(f"{stray[0]} configures the PD server: add --disaggregated", param_hint=stray[0])
    if disaggregated and gather_ms is not None:
        raise typer.BadParameter(
            "the PD server's router takes requests as they come: drop it", param_hint="--gather-ms"
        )
    layout = PDLayout(prefill_pp or 2, prefill_tp or 1, decode_tp or 2, transport or "shm", transfer_timeout or 30.0)
    faults = parse_faults(fault or [])
    tiers = tier_options(host_memory, store, store_master, store_memory, not no_prefix_cache)
    warmup = not no_warmup and not faults  # a fault names a request by its number: warm-up requests would shift it
    key = api_key or os.environ.get(API_KEY_ENV) or None
    name = random if random is not None else Path(model).name
    processes = Layout(layout.prefill_pp, layout.prefill_tp, layout.decode_tp) if disaggregated else Layout()
    command = "serve --disaggregated" if disaggregated else "serve"
    if chunk_size is None:
        chunk_size = CHUNK if disaggregated else SERVE_STEP_TOKENS
    if max_step_tokens is None and not disaggregated:
        max_step_tokens = max(SERVE_STEP_TOKENS, chunk_size)
    sized = size(
        command,
        model_spec(model, random, dtype),
        max_context=max_context,
        gpu_memory=gpu_memory,
        page_size=page_size,
        chunk_size=chunk_size,
        layout=processes,
    )
    options = EngineOptions(
        sized,
        sized.engine(
            max_running=max_running,
            max_step_tokens=max_step_tokens,
            dtype=getattr(torch, dtype),
            prefix_cache=not no_prefix_cache,
            checkpoints=engine_checkpoints(checkpoints, chunk_size, page_size),
            **tiers,
        ),
    )
    args = {
        "host": host,
        "port": port,
        "page_size": page_size,
        "chunk_size": chunk_size,
        "max_running": max_running,
        "max_step_tokens": max_step_tokens,
        "max_queued": max_queued,
        "max_context": sized.max_context,
        "prefix_cache": not no_prefix_cache,
        "checkpoints": options.engine.placement,
        "host_memory": host_memory,
        "store": store,
        "disaggregated": disaggregated,
        "dtype": dtype,
        "warmup": warmup,
        "api_key_set": key is not None,
    }
    config = ServerConfig(
        api_key=key,
        max_body_bytes=parse_bytes(max_body),
        connection_limits=connection_limits(max_header, header_timeout, max_connections),
        stream_interval=stream_interval,
        direct_writes=not loop_writes,
        tokenizer=text_tokenizer(tokenizer, model, random),
        model_path=str(model) if model is not None else f"random:{random}",
        model_aliases=frozenset() if model is None else frozenset({os.path.normpath(model), str(model.resolve())}),
        server_args=args,
    )
    with contextlib.ExitStack() as stack:
        sock = bind(host, port)  # before the model loads: a taken port fails at once
        stack.callback(sock.close)  # closed by the server once it serves; here on a failed start
        if disaggregated:
            backend: Backend = build_pd_backend(stack, model, random, name, layout, faults, max_queued, options)
        else:
            engine = build_engine(model, random, options)
            stack.callback(engine.close)  # its tiers: the store client, a master it started
            gather = {} if gather_ms is None else {"gather_gap_s": gather_ms / 1e3}
            backend = EngineBackend(engine, name, format_bytes(sized.gpu_memory), max_queued, **gather)
        sized.announce()
        code = run_server(backend, config, sock, shutdown_timeout, warmup=warmup)
    return code


def text_tokenizer(tokenizer: Path | None, model: Path | None, random: str | None) -> TextTokenizer | None:
    """The server's tokenizer: ``--tokenizer DIR``; else the ``--model`` directory's own when it holds one; else,
    for a ``--random`` model, the built-in byte tokenizer over its vocabulary (its bos and eos ids special);
    else none (token ids only)."""
    from hybridkv.server import ByteTokenizer, Tokenizer, has_tokenizer

    if tokenizer is not None:
        return Tokenizer(tokenizer)
    if model is not None:
        return Tokenizer(model) if has_tokenizer(model) else None
    if random is None:
        return None
    from hybridkv.engine.random_models import random_config
    from hybridkv.engine.registry import text_config

    config = text_config(random_config(random))
    special = [t for key in ("bos_token_id", "eos_token_id") for t in _ids(getattr(config, key, None))]
    return ByteTokenizer(config.vocab_size, special)


def _ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def model_spec(model: Path | None, random: str | None, dtype: str = "float32") -> ModelSpec:
    """The spec of ``--model DIR`` (its config.json, checked) or ``--random NAME`` served in ``dtype``,
    before any weights load."""
    import torch

    from hybridkv.engine.registry import engine_spec

    if random is not None:
        from hybridkv.engine.random_models import random_config

        return engine_spec(random_config(random), getattr(torch, dtype))
    from hybridkv.engine.weights import read_config

    return engine_spec(read_config(str(model)), getattr(torch, dtype))


@dataclass(frozen=True)
class EngineOptions:
    """How ``hybridkv serve`` builds its engine(s): the sizing outcome and the config every engine is built
    from (the one process's, or every rank's of a disaggregated server), sized by it."""

    sized: Sizing
    engine: EngineConfig


@dataclass(frozen=True)
class PDLayout:
    prefill_pp: int
    prefill_tp: int
    decode_tp: int
    transport: str
    transfer_timeout_s: float


def parse_faults(values: list[str]) -> tuple[Fault, ...]:
    """``--fault KIND:REQUEST[:RANK[:DELAY]]`` values as ``Fault``s (``typer.BadParameter`` naming the bad one)."""
    from hybridkv.engine.disagg import Fault
    from hybridkv.engine.disagg.faults import FAULTS

    faults = []
    for value in values:
        parts = value.split(":")
        try:
            if not 2 <= len(parts) <= 4:
                raise ValueError("give KIND:REQUEST[:RANK[:DELAY]]")
            kind, request, rank, delay = [*parts, "0", "1.0"][:4]
            if not (request.isdigit() and rank.isdigit()):
                raise ValueError("REQUEST and RANK are integers >= 0")
            if not math.isfinite(float(delay)):
                raise ValueError(f"DELAY {delay!r} is not a finite number of seconds")
            faults.append(Fault(kind, int(request), int(rank), float(delay)))
        except ValueError as exc:
            raise typer.BadParameter(
                f"{value!r}: {exc} (KIND one of {', '.join(FAULTS)}; REQUEST the 0-based submission index)",
                param_hint="--fault",
            ) from None
    return tuple(faults)


def build_pd_backend(
    stack: contextlib.ExitStack,
    model: Path | None,
    random: str | None,
    name: str,
    layout: PDLayout,
    faults: tuple[Fault, ...],
    max_queued: int,
    options: EngineOptions,
) -> PDBackend:
    """A started ``PDServer`` behind a ``PDBackend`` (which closes it); a ``--random`` model is saved to a
    temporary directory ``stack`` removes once the server is done. The engine config's tiers go below every
    prefill rank (one Mooncake master for all, started by the router unless named)."""
    from hybridkv.engine.disagg import PDConfig, PDServer
    from hybridkv.server import PDBackend

    if random is None:
        model_dir = str(model)
    else:
        from hybridkv.engine.random_models import save_random

        model_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="hybridkv-serve-"))
        save_random(random, model_dir)
    sized = options.sized
    config = PDConfig(
        model_dir,
        prefill_pp=layout.prefill_pp,
        prefill_tp=layout.prefill_tp,
        decode_tp=layout.decode_tp,
        transport=layout.transport,
        transfer_timeout_s=layout.transfer_timeout_s,
        faults=faults,
        engine=options.engine,
    )
    server = PDServer(config)  # checks the layout first: nothing starts on a mismatch
    return PDBackend(server, name, f"{format_bytes(sized.gpu_memory)} per worker process", max_queued)


def build_engine(model: Path | None, random: str | None, options: EngineOptions) -> Engine:
    from hybridkv.engine.engine import Engine  # lazily: the engine pulls in transformers

    if random is None:
        source, weights = model, None
    else:
        from hybridkv.engine.random_models import build_random

        weights, source = build_random(random)
    return Engine(source, weights, options.engine)


def _rate(value: float) -> float:
    if math.isnan(value) or value <= 0:
        raise typer.BadParameter(f"{value} must be above 0 requests per second (inf: all at once)")
    return value


def _peer(value: str | None) -> str | None:
    if value is not None and value not in PEERS:
        raise typer.BadParameter(f"{value!r} is not a server this bench runs against; choose one of {', '.join(PEERS)}")
    return value


@bench_app.command("serve")
def bench_serve(
    model: str = typer.Option("tiny-qwen3-next", "--model", callback=random_model, help="A tiny random model."),
    requests: int = typer.Option(64, "--requests", min=1),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", min=1),
    request_rate: float = typer.Option(8.0, "--request-rate", callback=_rate, help="Poisson arrivals per second."),
    rounds: int = typer.Option(2, "--rounds", min=1, help="Rounds under load, engine and HTTP alternating."),
    alone: int = typer.Option(16, "--alone", min=1, help="Requests served alone by both, for the HTTP overhead."),
    block_tokens: int = typer.Option(4, "--block-tokens", min=1, help="Tokens per 512-token trace block."),
    gpu_memory: str | None = GPU_MEMORY,
    max_context: int | None = MAX_CONTEXT,
    page_size: int | None = BENCH_PAGE_SIZE,
    chunk_size: int = CHUNK_SIZE,
    max_step_tokens: int | None = MAX_STEP_TOKENS,
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the arrival times."),
    url: str = typer.Option(None, "--url", help="A running server to load (default: start hybridkv serve here)."),
    api_key: str = typer.Option(None, "--api-key", help=f"Its API key (or set ${API_KEY_ENV})."),
    disaggregated: bool = typer.Option(
        False, "--disaggregated", help="Also hybridkv serve --disaggregated (its own subprocess), same requests."
    ),
    prefill_pp: int = typer.Option(2, "--prefill-pp", min=1, help="Prefill pipeline stages (--disaggregated)."),
    prefill_tp: int = typer.Option(1, "--prefill-tp", min=1, help="Prefill TP ranks per stage (--disaggregated)."),
    decode_tp: int = typer.Option(2, "--decode-tp", min=1, help="Decode TP ranks (--disaggregated)."),
    transport: str = typer.Option(
        "shm", "--transport", callback=transport_option, help=f"{TRANSPORT_CHOICES} (--disaggregated)."
    ),
    stream_interval: int = typer.Option(
        1, "--stream-interval", min=1, help="The servers' tokens per streamed chunk (hybridkv serve --stream-interval)."
    ),
    loop_writes: bool = typer.Option(
        False, "--loop-writes", help="The servers' event loops write every chunk (hybridkv serve --loop-writes)."
    ),
    compare_writes: bool = typer.Option(
        False, "--compare-writes", help="Also a server with the other write path, alone requests interleaved."
    ),
    dtype: str = DTYPE,
    peer: str = typer.Option(
        None, "--peer", callback=_peer, help=f"Against another server instead of the engine: {', '.join(PEERS)}."
    ),
    widen: int = typer.Option(
        8, "--widen", min=1, max=MAX_WIDEN, help="--peer: the model's widths times this (8: tiny-gemma3 at 512)."
    ),
    vocab: int = typer.Option(32000, "--vocab", min=256, max=1 << 20, help="--peer: the model's vocabulary."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", min=1, help="--peer: tokens per prompt (and prefix)."),
    connector: bool = typer.Option(
        True, "--connector/--no-connector", help='--peer: also the server "vLLM + HybridKVConnector".'
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Mooncake conversations at a request rate against hybridkv serve (streaming HTTP) and against the engine
    driven directly, alternating rounds: TTFT / TPOT / ITL, throughput, cache hits, HTTP overhead per request;
    with --disaggregated, against hybridkv serve --disaggregated too, on the same requests. With --peer vllm:
    hybridkv serve against vLLM's CPU build (scripts/setup_vllm.sh) and vLLM + HybridKVConnector on one widened
    model, rounds rotating (hybridkv.bench.vs_peer)."""
    from rich.console import Console
    from rich.table import Table

    from hybridkv.bench.engine import conversation_prompts
    from hybridkv.bench.serve import run

    pd_args = None
    starting = [name for name, on in (("--disaggregated", disaggregated), ("--compare-writes", compare_writes)) if on]
    if peer is not None and (url is not None or starting):
        given = "--url" if url is not None else starting[0]
        raise typer.BadParameter(f"--peer starts both servers itself; drop {given}", param_hint="--peer")
    if url is not None and starting:
        raise typer.BadParameter(f"--url loads a running server; {starting[0]} starts its own", param_hint="--url")
    if peer is not None:
        _bench_peer(
            model, widen, vocab, dtype, requests, prompt_tokens, max_new_tokens, rounds, alone, gpu_memory,
            page_size or PEER_PAGE_SIZE, seed, connector, as_json,
        )  # fmt: skip
        return
    page_size = page_size or PAGE
    if disaggregated:
        pd_args = ["--disaggregated", "--prefill-pp", str(prefill_pp), "--prefill-tp", str(prefill_tp)]
        pd_args += ["--decode-tp", str(decode_tp), "--transport", transport]
    lengths = [len(p) for p in conversation_prompts(requests, block_tokens)]
    # one budget for the engine, hybridkv serve and (per worker process) hybridkv serve --disaggregated: the
    # largest any of them needs; on a tie the disaggregated line is printed (its budget is per process)
    layouts = ([Layout(prefill_pp, prefill_tp, decode_tp)] if disaggregated else []) + [Layout()]
    spec = model_spec(None, model, dtype)
    sized = max(
        (
            size(
                "bench serve",
                spec,
                prompt_lengths=lengths,
                max_new_tokens=max_new_tokens,
                max_context=max_context,
                gpu_memory=gpu_memory,
                page_size=page_size,
                chunk_size=chunk_size,
                layout=layout,
            )
            for layout in layouts
        ),
        key=lambda s: s.gpu_memory,
    )
    sized.announce()

    report = run(
        model,
        requests,
        max_new_tokens,
        request_rate,
        rounds,
        alone,
        block_tokens,
        sized.gpu_memory,
        page_size,
        chunk_size,
        seed,
        url,
        api_key or os.environ.get(API_KEY_ENV),
        pd_args,
        sized.max_context,
        stream_interval,
        loop_writes,
        compare_writes,
        max_step_tokens,
        dtype,
    )
    if as_json:
        typer.echo(json.dumps(report))
        return
    lengths = report["prompt_tokens"]
    table = Table(
        title=f"{model}: {requests} requests at {request_rate}/s, prompts {lengths['min']}-{lengths['max']} tokens "
        f"(mean {lengths['mean']}), {max_new_tokens} new each, greedy, steps of {report['max_step_tokens']} tokens"
    )
    cols = ["round", "side", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms", "e2e p50/p99 ms"]
    for col in (*cols, "req/s", "tok/s", "prefix hits", "CPU s", "exact"):
        table.add_column(col, justify="right")
    exact = {"engine": None, "http": "exact", "pd": "pd_exact"}
    for r, row in enumerate(report["per_round"]):
        for side in [side for side in exact if side in row]:
            s = row[side]
            key = exact[side]
            table.add_row(
                str(r),
                side,
                *(f"{s[k]['p50']}/{s[k]['p99']}" for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")),
                f"{s['requests_per_s']}",
                f"{s['output_tokens_per_s']}",
                f"{100 * s['prefix_hit_rate']:.1f}%",
                "" if s["cpu_s"] is None else f"{s['cpu_s']:.2f}",
                "" if key is None else f"{row[key]}/{requests}",
            )
    console = Console(width=max(Console().width, 150))
    console.print(table)
    if pd_args is not None:
        console.print(f"pd: hybridkv serve {' '.join(pd_args)} (--gpu-memory per worker process; CPU not counted)")
    o, steady = report["overhead_ms"], report["overhead_steady_ms"]
    plain, plain_steady = report["overhead_plain_ms"], report["overhead_plain_steady_ms"]
    ends = report["endpoints"]
    console.print(
        "streamed alone, end-to-end p50: "
        + ", ".join(f"{name} {e2e['p50']} ms" for name, e2e in ends["e2e_ms"].items())
        + f"; /v1/completions / /generate {ends['completions_to_generate']}x, with logprobs / without "
        f"{ends['logprobs_to_plain']}x"
    )
    met = "met" if report["goal_met"] else "NOT met"
    console.print(
        f"HTTP overhead per request ({report['alone']} requests alone, {max_new_tokens} tokens each): streamed "
        f"({report['stream_interval']} token(s) a chunk, written by the {_writer(report['loop_writes'])}) "
        f"p50 {steady['p50']} ms, p99 {steady['p99']} ms with each side's engine CPU taken out (goal p50 <= "
        f"{report['goal_overhead_ms']} ms {met}); as HTTP e2e - engine e2e p50 {o['p50']} ms, p99 {o['p99']} ms. "
        f"Not streamed (one JSON answer): p50 {plain_steady['p50']} ms ({plain['p50']} ms as e2e - e2e).\n"
        f"CPU per streamed request: HTTP side of the server {report['http_cpu_ms']} ms (its event loop thread; "
        f"the rest besides the engine {report['server_other_cpu_ms']} ms); its engine thread "
        f"{report['engine_thread_cpu_ms']} ms ({report['stream_write_cpu_ms']} ms of it writing chunks) "
        f"vs the engine driven directly {report['engine_cpu_ms']} ms; "
        f"the bench's client {report['client_cpu_ms']} ms (two back-to-back scrapes of /metrics, taken out: loop "
        f"{report['scrape_cpu_ms']['loop']} ms, engine thread {report['scrape_cpu_ms']['engine_thread']} ms).\n"
        f"One chunk's send to a reader asleep in recv costs {report['send_after_step_us']['p50']} µs of CPU here right "
        f"after an engine step (p50; p99 {report['send_after_step_us']['p99']}), {report['send_wake_us']['p50']} µs "
        f"after an 8 MiB copy: the floor of each streamed chunk on this machine"
    )
    other = report["other_writes"]
    if other is not None:
        console.print(
            f"Side by side, the same requests interleaved: written by the {_writer(other['loop_writes'])}, "
            f"streamed p50 {other['overhead_steady_ms']['p50']} ms, p99 {other['overhead_steady_ms']['p99']} ms "
            f"(e2e - e2e p50 {other['overhead_ms']['p50']} ms); CPU per request: event loop {other['http_cpu_ms']} ms, "
            f"engine thread {other['engine_thread_cpu_ms']} ms ({other['stream_write_cpu_ms']} ms of it writing chunks)"
        )


def _bench_peer(
    model: str,
    widen: int,
    vocab: int,
    dtype: str,
    requests: int,
    prompt_tokens: int,
    max_new_tokens: int,
    rounds: int,
    alone: int,
    gpu_memory: str | None,
    page_size: int,
    seed: int,
    connector: bool,
    as_json: bool,
) -> None:
    """``bench serve --peer vllm``: skipped with one line (exit 0) when vLLM is not installed here."""
    from rich.console import Console
    from rich.table import Table

    from hybridkv.bench.vs_peer import CONNECTOR, peer_python
    from hybridkv.bench.vs_peer import run as run_peer

    python, why = peer_python(Path.cwd())
    if python is None:
        typer.echo(f"bench serve --peer vllm: skipped: {why}")
        return
    console = Console(width=max(Console().width, 150), stderr=as_json)
    try:
        report = run_peer(
            python, model, widen, vocab, dtype, requests, prompt_tokens, max_new_tokens, rounds, alone,
            parse_bytes(gpu_memory or "1GiB"), page_size, seed, log=lambda line: console.print(f"[dim]{line}[/dim]"),
            connector=connector,
        )  # fmt: skip
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--prompt-tokens") from None
    if as_json:
        typer.echo(json.dumps(report))
        return
    table = Table(
        title=f"{model} x{widen} (hidden {report['hidden_size']}, vocab {vocab}, {dtype}): {requests} requests at once "
        f"of {prompt_tokens} random tokens ('random'), of one {prompt_tokens}-token prefix + {report['suffix_tokens']} "
        f"('shared', prefix sent first); {alone} alone; {max_new_tokens} new each, greedy"
    )
    columns = ("round", "server", "workload", "req/s", "tok/s", "TTFT p50 ms", "hit tokens", "of them external")
    for col in (*columns, "alone ms", "exact (vs vLLM)"):
        table.add_column(col, justify="right")
    rows = [(str(r), row) for r, row in enumerate(report["per_round"])] + [("median", report["median"])]
    names = {"hybridkv": "hybridkv", "vllm": "vLLM", CONNECTOR: "vLLM + HybridKVConnector"}
    for label, row in rows:
        for server in report["servers"]:
            figures = row[server] if label != "median" else report["median"][server]
            same = {"hybridkv": "exact", CONNECTOR: "connector_exact"}.get(server)
            for workload in ("random", "shared"):
                f = figures[workload]
                exact = "" if label == "median" or same is None else f"{row[same][workload]}/{requests}"
                table.add_row(
                    label, names[server], workload, f"{f['requests_per_s']}", f"{f['output_tokens_per_s']}",
                    f"{f['ttft_p50_ms']}", f"{f['hit_tokens']}", f"{f.get('external_hit_tokens', '')}",
                    f"{figures['alone_ms']}", exact,
                )  # fmt: skip
    console.print(table)
    ratio = report["ratio"]
    console.print(
        "hybridkv / vLLM (medians; above 1: hybridkv better): "
        + "; ".join(
            f"{w}: req/s {ratio[w]['requests_per_s']}, tok/s {ratio[w]['output_tokens_per_s']}, "
            f"TTFT {ratio[w]['ttft_p50']} (vLLM's / hybridkv's)"
            for w in ("random", "shared")
        )
        + f"; alone {ratio['alone']} (vLLM's time / hybridkv's). vLLM + HybridKVConnector: vLLM's prefix cache reset "
        "after the shared prefix was sent, so its shared hits come from the connector"
    )


def _writer(loop_writes: bool) -> str:
    """Which thread of a server writes its streamed chunks."""
    return "event loop" if loop_writes else "engine thread"
