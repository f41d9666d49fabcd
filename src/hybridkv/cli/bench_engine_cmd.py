"""``hybridkv bench engine``: engine tokens/s vs transformers generate, and hybridkv's share of a step."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from hybridkv.cli.app import bench_app
from hybridkv.cli.params import byte_size


@bench_app.command("engine")
def bench_engine(
    model: list[str] = typer.Option(None, "--model", help="A tiny random model (repeatable; default: all five)."),
    requests: int = typer.Option(64, "--requests", min=1),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", min=1),
    block_tokens: int = typer.Option(4, "--block-tokens", min=1, help="Tokens per 512-token trace block."),
    gpu_memory: str = typer.Option("256MiB", "--gpu-memory", callback=byte_size),
    page_size: int = typer.Option(16, "--page-size", min=1),
    chunk_size: int = typer.Option(64, "--chunk-size", min=1),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Serve without the prefix cache."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Mooncake conversations scaled down, served by the engine and by transformers one by one, same run."""
    from hybridkv.bench.engine import run

    report = run(
        model or None, requests, max_new_tokens, block_tokens, gpu_memory, page_size, chunk_size, not no_prefix_cache
    )
    if as_json:
        typer.echo(json.dumps(report))
        return
    lengths = report["prompt_tokens"]
    table = Table(
        title=f"{report['requests']} requests, prompts {lengths['min']}-{lengths['max']} tokens "
        f"(mean {lengths['mean']}), {report['max_new_tokens']} new each, 1 torch thread"
    )
    for col in ("model", "engine tok/s", "HF tok/s", "speedup", "step ms", "hybridkv share", "prefix hits", "exact"):
        table.add_column(col)
    for r in report["models"]:
        table.add_row(
            r["model"],
            f"{r['engine_tokens_per_s']:,.0f}",
            f"{r['transformers_tokens_per_s']:,.0f}",
            f"{r['speedup']:.2f}x",
            f"{r['step_ms']:.1f}",
            f"{100 * r['hybridkv_share']:.1f}%",
            f"{100 * r['prefix_hit_rate']:.1f}%",
            f"{r['exact']}/{report['requests']}",
        )
    console = Console()
    console.print(table)
    goals = report["goals"]
    for r in report["models"]:
        speed = "met" if r["speedup_met"] else "NOT met"
        share = "met" if r["share_met"] else "NOT met"
        console.print(
            f"  {r['model']}: >= {goals['speedup']:.0f}x transformers {speed}; "
            f"hybridkv calls <= {100 * goals['hybridkv_share']:.0f}% of a step {share}"
        )
