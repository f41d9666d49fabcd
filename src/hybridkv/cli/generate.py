"""``hybridkv generate``: serve a file of token prompts through the reference engine.

Which errors are whose:
- Refused before any generation, one ``error:`` line, exit 2 (``main``'s error path): a missing
  ``--model`` directory or ``--prompts`` file, a model directory without ``config.json`` or
  ``*.safetensors`` or with weights that do not fit, a line that is not ``{"prompt_ids": [int, ...]}``,
  and every prompt the engine would refuse (``Engine.check``: empty, ids outside the vocabulary,
  prompt + ``--max-new-tokens`` beyond ``--max-context``; the message names the file line), a
  budget below one request's floor, and bad option values (typer ``min=``, ``cli/params.py``).
  A file is checked as a whole, so a bad line costs nothing but the model load. Tier options that
  do not fit together (``--store-master`` without ``--store mooncake``, tiers with
  ``--no-prefix-cache``) and a ``--store-master`` no master answers at are refused the same way.
- Sizing (``cli/sizing.py``, the same for every command): the max context is the longest prompt +
  ``--max-new-tokens`` unless ``--max-context`` says otherwise, the budget the default or what that
  context needs; printed as one line on stderr at start.
- Reported per request while the others finish (``error`` in the output, exit 0): what only
  happens while serving, i.e. a request that does not fit the memory budget even alone.

Output (``--json``): one object; ``requests`` in input order, each ``output_ids``,
``finish_reason`` (``length``, ``eos``, ``stop`` or ``error``), ``error`` (null when none),
``cached_tokens`` and ``cached_tokens_details`` {device, host, storage}; ``totals``.
``--host-memory`` and ``--store mooncake`` put tiers below the device (``hybridkv.engine.sched.tiered``).
Sampling (``--temperature``, ``--top-p``, ``--top-k``, ``--seed``, ``--stop-token-id``, ``--ignore-eos``)
is the same for ``serve-pd``: the same file gives the same tokens there.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import typer

from hybridkv.cli.app import app
from hybridkv.cli.params import (
    CHECKPOINTS_HELP,
    DTYPE,
    HOST_MEMORY,
    IGNORE_EOS,
    MAX_RUNNING,
    MAX_STEP_TOKENS,
    SEED,
    STOP_TOKEN_IDS,
    STORE,
    STORE_MASTER,
    STORE_MEMORY,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    engine_checkpoints,
    random_model,
    request_params,
    tier_options,
)
from hybridkv.cli.sizing import CHUNK_SIZE, GPU_MEMORY, MAX_CONTEXT, PAGE_SIZE, Sizing, size
from hybridkv.engine.random_models import tiny_names


class PromptFileError(ValueError):
    """A prompts file the engine cannot serve as a whole (names the file and line)."""


class _PromptLine(msgspec.Struct, forbid_unknown_fields=True):
    prompt_ids: list[int]


_PROMPT_LINE = msgspec.json.Decoder(_PromptLine)


def read_prompts(path: Path) -> list[tuple[int, list[int]]]:
    """``(line number, prompt_ids)`` of every non-blank line of a JSONL file, schema-checked."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PromptFileError(f"cannot read prompts file {str(path)!r}: {exc.strerror or exc}") from None
    prompts = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append((lineno, _PROMPT_LINE.decode(line).prompt_ids))
        except msgspec.DecodeError as exc:  # ValidationError included
            raise PromptFileError(
                f'{path}:{lineno}: not a prompt line ({exc}); write {{"prompt_ids": [token ids]}}'
            ) from None
    if not prompts:
        raise PromptFileError(f'{path}: holds no prompts; write one {{"prompt_ids": [...]}} object per line')
    return prompts


def model_source(model: Path | None, random: str | None) -> tuple[Any, Any, Any]:
    """``(source, weights, config)`` of ``--model DIR`` or ``--random NAME`` (exactly one): what ``Engine`` takes,
    and the model's ``transformers`` config."""
    if (model is None) == (random is None):
        raise typer.BadParameter("give exactly one of --model DIR and --random NAME", param_hint="--model/--random")
    if random is None:
        from hybridkv.engine.weights import read_config

        return model, None, read_config(model)  # type: ignore[arg-type]
    from hybridkv.engine.random_models import build_random

    weights, config = build_random(random)
    return config, weights, config


@app.command()
def generate(
    prompts: Path = typer.Option(
        ..., "--prompts", exists=True, dir_okay=False, help='JSONL file, one {"prompt_ids": [...]} per line.'
    ),
    model: Path = typer.Option(
        None, "--model", exists=True, file_okay=False, help="Directory with config.json + *.safetensors."
    ),
    random: str = typer.Option(
        None, "--random", callback=random_model, help=f"A tiny random model: {', '.join(tiny_names())}."
    ),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", min=1),
    gpu_memory: str | None = GPU_MEMORY,
    max_context: int | None = MAX_CONTEXT,
    page_size: int = PAGE_SIZE,
    chunk_size: int = CHUNK_SIZE,
    max_running: int = MAX_RUNNING,
    max_step_tokens: int | None = MAX_STEP_TOKENS,
    temperature: float = TEMPERATURE,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    seed: int = SEED,
    stop_token_ids: list[int] | None = STOP_TOKEN_IDS,
    ignore_eos: bool = IGNORE_EOS,
    no_prefix_cache: bool = typer.Option(
        False, "--no-prefix-cache", help="Compute every prompt in full (no prefix-cache hits between requests)."
    ),
    checkpoints: str | None = typer.Option(None, "--checkpoints", help=CHECKPOINTS_HELP),
    host_memory: str | None = HOST_MEMORY,
    store: str = STORE,
    store_master: str | None = STORE_MASTER,
    store_memory: str = STORE_MEMORY,
    dtype: str = DTYPE,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Generate tokens for every prompt of a file (continuous batching, chunked prefill, greedy by default)."""
    import torch

    from hybridkv.engine.engine import Engine
    from hybridkv.engine.registry import engine_spec

    lines = read_prompts(prompts)
    params = request_params(len(lines), max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos)
    tiers = tier_options(host_memory, store, store_master, store_memory, not no_prefix_cache)
    checkpoints = engine_checkpoints(checkpoints, chunk_size, page_size)
    source, weights, config = model_source(model, random)
    sizing = size(
        "generate",
        engine_spec(config, getattr(torch, dtype)),
        prompt_lengths=[len(ids) for _, ids in lines],
        max_new_tokens=max_new_tokens,
        max_context=max_context,
        gpu_memory=gpu_memory,
        page_size=page_size,
        chunk_size=chunk_size,
    )
    engine = Engine(
        source,
        weights,
        sizing.engine(
            max_running=max_running,
            max_step_tokens=max_step_tokens,
            prefix_cache=not no_prefix_cache,
            checkpoints=checkpoints,
            dtype=getattr(torch, dtype),
            **tiers,
        ),
    )
    try:
        _serve_file(engine, sizing, prompts, lines, params, max_new_tokens, as_json)
    finally:
        engine.close()


def _serve_file(
    engine: Any,
    sizing: Sizing,
    prompts: Path,
    lines: list[tuple[int, list[int]]],
    params: list[Any],
    max_new_tokens: int,
    as_json: bool,
) -> None:
    bad = [(n, why) for n, ids in lines if (why := engine.check(ids, max_new_tokens)) is not None]
    if bad:
        more = f" (and {len(bad) - 1} more bad lines)" if len(bad) > 1 else ""
        raise PromptFileError(f"{prompts}:{bad[0][0]}: {bad[0][1]}{more}")
    sizing.announce()

    ids = [p for _, p in lines]
    start = time.perf_counter()
    if not as_json and sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import Progress

        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("generating", total=len(ids))
            outs = engine.generate(ids, params, on_output=lambda i, out: progress.advance(task))
    else:
        outs = engine.generate(ids, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.output_ids) for o in outs)
    totals = {
        "requests": len(outs),
        "errors": sum(o.error is not None for o in outs),
        "prompt_tokens": sum(len(p) for p in ids),
        "output_tokens": produced,
        "seconds": round(seconds, 4),
        "output_tokens_per_s": round(produced / seconds, 1) if seconds > 0 else None,
        "steps": engine.stats["steps"],
        "retractions": engine.stats["retractions"],
        "cached_tokens": sum(o.cached_tokens for o in outs),
        "cached_tokens_details": {
            k: sum(o.cached_tokens_details[k] for o in outs) for k in ("device", "host", "storage")
        },
    }
    if as_json:
        requests = [
            {
                "output_ids": o.output_ids,
                "finish_reason": o.finish_reason,
                "error": o.error,
                "cached_tokens": o.cached_tokens,
                "cached_tokens_details": o.cached_tokens_details,
            }
            for o in outs
        ]
        typer.echo(json.dumps({"model": engine.spec.name, "requests": requests, "totals": totals}))
        return
    for i, out in enumerate(outs):
        text = out.error if out.error is not None else " ".join(map(str, out.output_ids))
        typer.echo(
            f"request {i} ({len(ids[i])} prompt tokens, {out.cached_tokens} cached, {out.finish_reason}): {text}"
        )
    typer.echo(
        f"{totals['requests']} requests, {produced} tokens in {seconds:.2f} s "
        f"({totals['output_tokens_per_s']} tokens/s), {totals['steps']} steps, "
        f"{totals['retractions']} retractions, {totals['errors']} errors"
    )
