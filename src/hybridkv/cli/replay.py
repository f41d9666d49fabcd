"""``hybridkv replay``: serve a real trace through memory + cache (tables only) and report hit
rate, evictions, concurrency and the pool split."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from hybridkv.cache import POLICIES
from hybridkv.cli.app import app
from hybridkv.cli.params import byte_size, positive_finite


def _cache_tokens(text: str) -> int | None:
    if text.strip().lower() in ("inf", "unbounded", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise typer.BadParameter(f"--cache-tokens takes a token count or 'inf', got {text!r}") from None
    if value < 0:
        raise typer.BadParameter(f"--cache-tokens must be >= 0, got {value}")
    return value


def _policies(text: str) -> list[str]:
    names = sorted(POLICIES) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise typer.BadParameter(f"unknown policy {unknown or text!r}; choose from {sorted(POLICIES)} or 'all'")
    return names


@app.command("replay")
def replay(
    trace: str = typer.Option(
        ...,
        "--trace",
        help="Mooncake .jsonl(.gz), peer_trace .json(.gz) (radix part), or built-in mooncake-conversation / peer.",
    ),
    model: str = typer.Option(..., "--model", help="Model preset name (e.g. Qwen3-Next-80B-A3B-Instruct)."),
    gpu_memory: str = typer.Option(
        ..., "--gpu-memory", callback=byte_size, help="KV budget of one device, e.g. 40GiB."
    ),
    page_size: int = typer.Option(16, "--page-size", min=1),
    policy: str = typer.Option("lru", "--policy", help="lru, lfu, priority, cost; comma list or 'all' to compare."),
    cache_tokens: str = typer.Option(
        "inf", "--cache-tokens", help="Cache size cap in tokens (held once requests unlock), or 'inf'."
    ),
    limit: int = typer.Option(None, "--limit", min=1, help="Replay only the first N requests."),
    prefill_tps: float = typer.Option(
        50_000.0, "--prefill-tps", callback=positive_finite, help="Simulated prefill tokens per second."
    ),
    decode_step_ms: float = typer.Option(
        25.0, "--decode-step-ms", callback=positive_finite, help="Simulated time of one decode step."
    ),
    max_running: int = typer.Option(128, "--max-running", min=1, help="Most requests decoding at once."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    plot: str = typer.Option(None, "--plot", help="Write the pool split over time to this PNG."),
) -> None:
    """Simulate serving a trace: hit rate (overall and per component), evictions, concurrency."""
    from hybridkv.replay import EngineModel, ReplayConfig, build_report, compare, load_workload, plot_pool_split
    from hybridkv.replay.simulator import Simulator

    policies = _policies(policy)
    cap = _cache_tokens(cache_tokens)
    workload = load_workload(trace, limit=limit)
    engine = EngineModel(prefill_tokens_per_s=prefill_tps, decode_step_s=decode_step_ms / 1000, max_running=max_running)
    reports = []
    console = Console(stderr=True)
    for name in policies:
        config = ReplayConfig(model, gpu_memory, page_size, name, cap, engine=engine)
        sim = Simulator(workload, config)
        with Progress(
            TextColumn(f"replay [{name}]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=as_json,
        ) as bar:
            task = bar.add_task("requests", total=len(workload.requests))

            def progress(done: int, _total: int, task: TaskID = task) -> None:
                bar.update(task, completed=done)

            result = sim.run(progress)
        reports.append(build_report(result))
    out: dict[str, Any] = {"runs": reports, "comparison": compare(reports)}
    if plot:
        out["plot"] = str(plot_pool_split(reports, plot))
    if as_json:
        typer.echo(json.dumps(out))
        return
    _print_replay(out)


def _print_replay(out: dict[str, Any]) -> None:
    console = Console(width=max(Console().width, 120))
    first = out["runs"][0]
    console.print(
        f"[bold]{first['model']}[/] on {first['workload']}: {first['requests']:,} requests, "
        f"{first['input_tokens']:,} input tokens, {first['gpu_memory']} KV, page size {first['page_size']}, "
        f"cache cap {first['cache_tokens']}"
    )
    table = Table(title="hit rate (tokens) by component rules")
    for col in ("policy", "full only", "full+SWA", "full+state", "all (served)", "SWA cost", "state cost"):
        table.add_column(col)
    for r in out["runs"]:
        rate, cost = r["hit_rate_by_component"], r["validity_cost"]
        table.add_row(
            r["policy"],
            f"{rate['full_only']:.4f}",
            f"{rate['full+swa']:.4f}",
            f"{rate['full+state']:.4f}",
            f"[bold]{rate['all']:.4f}[/]",
            f"{cost['swa']:.4f}",
            f"{cost['state']:.4f}",
        )
    console.print(table)
    table = Table(title="evictions, concurrency, speed")
    cols = ("policy", "full pages", "SWA tombstoned", "states", "retracted", "peak running", "peak pages")
    for col in (*cols, "req/s", "sim s / s"):
        table.add_column(col)
    for r in out["runs"]:
        ev, sp = r["evictions"], r["speed"]
        table.add_row(
            r["policy"],
            f"{ev['full_pages']:,}",
            f"{sum(ev['window_pages_tombstoned'].values()):,}",
            f"{ev['states']:,}",
            str(r["retractions"]),
            str(r["peak_running"]),
            f"{r['peak_live_pages']:,}",
            f"{sp['requests_per_s']:,.0f}",
            f"{sp['simulated_s_per_wall_s']:,.0f}",
        )
    console.print(table)
    if "plot" in out:
        console.print(f"pool split over time: {out['plot']}")
