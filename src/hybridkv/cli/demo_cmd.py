"""``hybridkv demo``: the main job, end to end on real presets and real traces."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from hybridkv.cli.app import app
from hybridkv.memory import format_bytes, parse_bytes


@app.command()
def demo(
    out: Path = typer.Option(Path("out/demo"), "--out", help="Where PNGs and the JSON report go."),
    gpu_memory: str = typer.Option("80GiB", "--gpu-memory"),
) -> None:
    """Planner on real models, a simulated allocation run (PNG of the pool split)."""
    from hybridkv.demo import plan_summary, plot_timeline, split_timeline

    console = Console()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {}

    console.rule("1. How many requests fit on one GPU: unified pool vs SGLang's default static split")
    rows = plan_summary(gpu_memory)
    table = Table()
    for col in ("model", "context", "unified", "static", "unified/static"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["model"], f"{r['context']:,}", f"{r['unified']:,}", f"{r['static']:,}", f"{r['ratio']:.2f}x")
    console.print(table)
    report["plan"] = rows

    console.rule("2. Serving the Mooncake conversation trace (tables only): the byte split floats")
    timeline = split_timeline("Qwen3-Next-80B-A3B-Instruct", parse_bytes("40GiB"), requests=300)
    png = out / "pool_split.png"
    plot_timeline(timeline, png)
    peak = {name: format_bytes(max(v)) for name, v in timeline["samples"].items()}
    console.print(
        f"peak bytes per pool: {peak}; {timeline['preempted']} preemptions when the arena filled; plot: {png}"
    )
    report["split_timeline"] = {"model": timeline["model"], "budget": timeline["budget"], "peak": peak, "png": str(png)}

    (out / "demo.json").write_text(json.dumps(report, indent=1))
    console.print(f"report: {out / 'demo.json'}")
