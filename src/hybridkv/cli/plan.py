"""Planning commands: ``hybridkv plan`` (what fits per stage and pool, unified vs static split),
``hybridkv presets`` and ``hybridkv transfer-plan`` (what each prefill rank sends each decode rank).

The reports come from ``hybridkv.planner``, imported when a command runs (after its options are
checked); this module parses options and renders tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from hybridkv.cli.app import app
from hybridkv.cli.params import byte_size, preset
from hybridkv.units import format_bytes

if TYPE_CHECKING:
    from hybridkv.spec import ModelSpec

MAX_RANKS = 64


@app.command()
def plan(
    model: str | None = typer.Option(
        None, "--model", "-m", callback=preset, help="Preset name (see `hybridkv presets`)."
    ),
    hf_config: Path | None = typer.Option(
        None, "--hf-config", help="A Hugging Face config.json (or its folder) instead of a preset."
    ),
    gpu_memory: str = typer.Option("80GiB", "--gpu-memory", callback=byte_size, help="Bytes for KV + state per GPU."),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel size."),
    pp: int = typer.Option(1, "--pp", min=1, help="Pipeline-parallel size."),
    page_size: int = typer.Option(16, "--page-size", min=1, help="Tokens per KV page."),
    context: list[int] = typer.Option(None, "--context", min=1, help="Request lengths to size for (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """How many tokens and concurrent requests fit per stage, unified pool vs a static split."""
    if (model is None) == (hf_config is None):
        raise typer.BadParameter("give exactly one of --model (a preset) and --hf-config (a config.json)")
    from hybridkv.planner import plan_report
    from hybridkv.spec import from_hf_config

    spec: str | ModelSpec = from_hf_config(hf_config) if hf_config is not None else str(model)
    report = plan_report(spec, gpu_memory, tp, pp, page_size, context)
    if as_json:
        typer.echo(json.dumps(report))
        return
    console = Console()
    console.print(
        f"[bold]{report['model']}[/] on {format_bytes(report['gpu_memory_bytes'])} per GPU, "
        f"TP {tp} PP {pp}, page {page_size} tokens"
    )
    for stage in report["stages"]:
        table = Table(title=f"stage {stage['pp_rank']}: layers [{stage['layers'][0]}, {stage['layers'][1]})")
        for col in ("pool", "layers", "cell", "per token", "per request", "window"):
            table.add_column(col)
        for pool in stage["pools"]:
            table.add_row(
                pool["pool"],
                str(pool["layers"]),
                format_bytes(pool["cell_bytes"]),
                format_bytes(pool["bytes_per_token"]) if pool["bytes_per_token"] else "-",
                format_bytes(pool["bytes_per_request"]) if pool["bytes_per_request"] else "-",
                str(pool["window"] or "-"),
            )
        console.print(table)
        fit = Table(title=f"concurrent requests (one request max {stage['max_tokens_one_request']:,} tokens)")
        for col in ("context", "bytes/request", "unified", "static (SGLang defaults)", "unified/static"):
            fit.add_column(col)
        for row in stage["requests"]:
            ratio = row["unified_over_static"]
            fit.add_row(
                f"{row['context']:,}",
                format_bytes(row["bytes_per_request"]),
                f"{row['unified']:,}",
                f"{row['static_sglang_default']:,}",
                f"{ratio:.2f}x" if ratio else "-",
            )
        console.print(fit)


@app.command()
def presets() -> None:
    """List the model presets: real models (published configs) and tiny test models."""
    from hybridkv.spec import get_preset, preset_names

    for name in preset_names():
        typer.echo(get_preset(name).describe())


@app.command("transfer-plan")
def transfer_plan(
    model: str = typer.Option(..., "--model", callback=preset, help="Preset name (hybridkv presets)."),
    prefill_pp: int = typer.Option(1, "--prefill-pp", min=1, max=MAX_RANKS),
    prefill_tp: int = typer.Option(1, "--prefill-tp", min=1, max=MAX_RANKS),
    decode_tp: int = typer.Option(1, "--decode-tp", min=1, max=MAX_RANKS),
    seq_len: int = typer.Option(4096, "--seq-len", help="Tokens of the request.", min=1),
    page_size: int = typer.Option(16, "--page-size", min=1, max=1 << 16),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """What each prefill rank sends each decode rank for one request: pairs, ops, bytes."""
    from hybridkv.planner import transfer_plan_report

    report = transfer_plan_report(model, prefill_pp, prefill_tp, decode_tp, seq_len, page_size)
    if as_json:
        typer.echo(json.dumps(report))
        return
    table = Table(
        title=f"{report['model']}: prefill pp {prefill_pp} tp {prefill_tp} -> decode tp {decode_tp}, "
        f"{seq_len} tokens, pages of {page_size}"
    )
    for col in ("prefill (pp, tp)", "decode tp", "layers", "entry pairs", "pieces", "ops", "bytes"):
        table.add_column(col, justify="right")
    for leg in report["legs"]:
        layers = leg["layers"]
        span = f"{layers[0]}..{layers[-1]} ({len(layers)})" if layers else "-"
        table.add_row(
            str(tuple(leg["prefill"])),
            str(leg["decode_tp"]),
            span,
            str(leg["pairs"]),
            f"{leg['pieces']:,}",
            f"{leg['ops']:,}",
            format_bytes(leg["bytes"]),
        )
    Console().print(table)
