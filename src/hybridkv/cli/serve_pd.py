"""``hybridkv serve-pd``: serve a prompts file disaggregated (PP x TP prefill processes -> TP decode processes).

The same prompts file and ``output_ids`` JSON as ``hybridkv generate`` (``read_prompts``), plus
per request its ``status`` (``finished`` / ``failed``, with ``error`` the reason), its prefill-side
prefix-cache hit (``cached_tokens``), the KV/state bytes moved, ``attempts`` (2 when an engine died
holding it and it was computed again) and ``timings`` (``engine.disagg.RequestTiming``: queue,
prefill, transfer, decode, TTFT, TPOT, seconds; null when failed). The same sampling options as
``generate`` (greedy by default); a request ends inside the engine at EOS, a stop id or
``--max-new-tokens`` (``finish_reason`` ``eos``, ``stop``, ``length``; ``error`` for a failed request),
so the same file gives ``generate``'s tokens. KV/state move over ``shm`` or ``mooncake`` (TCP on
127.0.0.1).

Sizing (``cli/sizing.py``, the same for every command): the max context is the longest prompt +
``--max-new-tokens`` unless ``--max-context`` says otherwise; ``--gpu-memory`` is per process, by
default what that context needs on every rank (at least 256 MiB); printed as one line on stderr.

Refused before any process starts, one ``error:`` line, exit 2: a missing ``--prompts`` file or
``--model`` directory, a bad prompt line, ids outside the vocabulary or a prompt + ``--max-new-tokens``
beyond ``--max-context`` (the message names the file line), ``--prefill-pp`` / ``--prefill-tp`` /
``--decode-tp`` / ``--max-new-tokens`` below 1, a layout the model cannot be split into or a decode
layout that does not pair with the prefill one (``check_layout``: e.g. ``--decode-page-size`` other
than ``--page-size``), a checkpoint some rank cannot load (checked from the files' headers), and an
unknown transport, and tier options that do not fit together (``tier_options``).

``--host-memory`` / ``--store mooncake`` put tiers below every prefill rank (one master for all, started on
127.0.0.1 by the router unless ``--store-master`` names one); the JSON
says per request where its cached tokens came from (``cached_tokens_details``: device, host, storage).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

from hybridkv.cli.app import app
from hybridkv.cli.generate import PromptFileError, read_prompts
from hybridkv.cli.params import (
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
    TRANSPORT_CHOICES,
    random_model,
    request_params,
    tier_options,
    transport_option,
)
from hybridkv.cli.sizing import CHUNK_SIZE, GPU_MEMORY, MAX_CONTEXT, PAGE_SIZE, Layout, size
from hybridkv.engine.random_models import tiny_names


def _check_prompts(
    prompts: Path, lines: list[tuple[int, list[int]]], params: list[Any], vocab: int, context: int, given: bool
) -> None:
    from hybridkv.engine.sched.request import RequestError, check_request

    for (lineno, ids), p in zip(lines, params, strict=True):
        try:
            check_request(ids, p, vocab, context)
        except RequestError as exc:
            why = str(exc).split(": ", 1)[1]
            why = why.replace("the context of", "--max-context") if given else why
            raise PromptFileError(f"{prompts}:{lineno}: {why}") from None


@app.command("serve-pd")
def serve_pd(
    prompts: Path = typer.Option(
        ..., "--prompts", exists=True, dir_okay=False, help='JSONL file, one {"prompt_ids": [...]} per line.'
    ),
    model: Path = typer.Option(
        None, "--model", exists=True, file_okay=False, help="Directory with config.json + *.safetensors."
    ),
    random: str = typer.Option(
        None, "--random", callback=random_model, help=f"A tiny random model: {', '.join(tiny_names())}."
    ),
    prefill_pp: int = typer.Option(2, "--prefill-pp", min=1, help="Prefill pipeline stages."),
    prefill_tp: int = typer.Option(1, "--prefill-tp", min=1, help="Prefill tensor-parallel ranks per stage."),
    decode_tp: int = typer.Option(2, "--decode-tp", min=1, help="Decode tensor-parallel ranks (one process each)."),
    transport: str = typer.Option(
        "shm", "--transport", callback=transport_option, help=f"KV/state transport: {TRANSPORT_CHOICES}."
    ),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", min=1),
    temperature: float = TEMPERATURE,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    seed: int = SEED,
    stop_token_ids: list[int] | None = STOP_TOKEN_IDS,
    ignore_eos: bool = IGNORE_EOS,
    gpu_memory: str | None = GPU_MEMORY,
    max_context: int | None = MAX_CONTEXT,
    page_size: int = PAGE_SIZE,
    decode_page_size: int = typer.Option(
        None, "--decode-page-size", min=1, help="Decode page size (default: --page-size; must pair with prefill)."
    ),
    chunk_size: int = CHUNK_SIZE,
    max_running: int = MAX_RUNNING,
    max_step_tokens: int | None = MAX_STEP_TOKENS,
    host_memory: str | None = HOST_MEMORY,
    store: str = STORE,
    store_master: str | None = STORE_MASTER,
    store_memory: str = STORE_MEMORY,
    dtype: str = DTYPE,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Serve every prompt of a file through PP prefill processes and TP decode processes."""
    import torch

    from hybridkv.engine.disagg import FINISHED, PDConfig, check_layout, pd_path, run_pd
    from hybridkv.engine.registry import engine_spec, text_config
    from hybridkv.engine.sched.request import FinishReason
    from hybridkv.engine.weights import read_config

    if (model is None) == (random is None):
        raise typer.BadParameter("give exactly one of --model DIR and --random NAME", param_hint="--model/--random")
    tiers = tier_options(host_memory, store, store_master, store_memory)
    lines = read_prompts(prompts)
    params = request_params(len(lines), max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos)
    with tempfile.TemporaryDirectory(prefix="hybridkv-serve-pd-") as tmp:
        if random is not None:
            from hybridkv.engine.random_models import save_random

            save_random(random, tmp)
            model_dir = tmp
        else:
            model_dir = str(model)
        text = text_config(read_config(model_dir))
        layout = Layout(prefill_pp, prefill_tp, decode_tp, decode_page_size)
        sizing = size(
            "serve-pd",
            engine_spec(text, getattr(torch, dtype)),
            prompt_lengths=[len(ids) for _, ids in lines],
            max_new_tokens=max_new_tokens,
            max_context=max_context,
            gpu_memory=gpu_memory,
            page_size=page_size,
            chunk_size=chunk_size,
            layout=layout,
        )
        _check_prompts(prompts, lines, params, int(text.vocab_size), sizing.max_context, max_context is not None)
        config = PDConfig(
            model_dir,
            tuple(tuple(ids) for _, ids in lines),
            max_new_tokens,
            prefill_pp=prefill_pp,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            transport=transport,
            decode_page_size=decode_page_size,
            engine=sizing.engine(
                max_running=max_running,
                max_step_tokens=max_step_tokens,
                dtype=getattr(torch, dtype),
                **tiers,
            ),
        )
        check_layout(config)
        sizing.announce()
        result = run_pd(config, params)
    name = random if random is not None else str(model)
    paths = [pd_path(r) for r in result.requests]
    outs = [
        (r.output_ids, r.finish_reason) if path.status == FINISHED else ([], FinishReason.ERROR)
        for r, path in zip(result.requests, paths, strict=True)
    ]
    if as_json:
        requests = [
            {
                "output_ids": tokens,
                "finish_reason": reason,
                "status": path.status,
                "error": r.error or None,
                "cached_tokens": r.cached_tokens,
                "cached_tokens_details": r.cached_tokens_details,
                "transfer_bytes": path.transfer_bytes,
                "attempts": path.attempts,
                "timings": None if path.timing is None else {k: round(v, 6) for k, v in asdict(path.timing).items()},
            }
            for (tokens, reason), r, path in zip(outs, result.requests, paths, strict=True)
        ]
        totals = {
            "requests": len(outs),
            "errors": sum(path.status != FINISHED for path in paths),
            "prompt_tokens": sum(len(ids) for _, ids in lines),
            "output_tokens": sum(len(tokens) for tokens, _ in outs),
            "prefill_pp": prefill_pp,
            "prefill_tp": prefill_tp,
            "decode_tp": decode_tp,
            "transport": transport,
        }
        typer.echo(json.dumps({"model": name, "requests": requests, "totals": totals}))
        return
    for i, ((tokens, reason), r, path) in enumerate(zip(outs, result.requests, paths, strict=True)):
        head = f"request {i} ({len(lines[i][1])} prompt tokens, {r.cached_tokens} cached"
        t = path.timing
        if t is None:
            typer.echo(f"{head}): FAILED: {r.error or ''}")
            continue
        typer.echo(
            f"{head}, {reason}): {' '.join(map(str, tokens))}  "
            f"[queue {t.queue_s * 1e3:.1f} ms, prefill {t.prefill_s * 1e3:.1f} ms, "
            f"transfer {t.transfer_s * 1e3:.1f} ms ({path.transfer_bytes} B), decode {t.decode_s * 1e3:.1f} ms, "
            f"TTFT {t.ttft_s * 1e3:.1f} ms, TPOT {t.tpot_s * 1e3:.1f} ms]"
        )
    failed = sum(path.status != FINISHED for path in paths)
    typer.echo(
        f"{len(outs)} requests ({failed} failed): PP {prefill_pp} x TP {prefill_tp} prefill -> "
        f"TP {decode_tp} decode over {transport}"
    )
