"""``hybridkv bench memory``: allocator replay of the peer trace, hybridkv vs static pools."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from hybridkv.cli.app import bench_app
from hybridkv.traces import PEER_TRACE


@bench_app.command("memory")
def bench_memory(
    trace: str = typer.Option(
        PEER_TRACE, "--trace", help='peer_trace.json (plain or .gz), or the built-in name "peer".'
    ),
    page_size: int = typer.Option(16, "--page-size", min=1),
    config: list[str] = typer.Option(None, "--config", help="full, full+swa, full+state (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Calls/s, p50/p99 per op and host syncs, side by side with a static-pool baseline."""
    from hybridkv.bench.memory import run

    report = run(trace, page_size, config)
    if as_json:
        typer.echo(json.dumps(report))
        return
    console = Console()
    for name, res in report["configs"].items():
        table = Table(title=f"{name} ({res['model']}), page size {report['page_size']}, 1 torch thread")
        for col in ("allocator", "calls", "calls/s", "host syncs", "op", "p50 us", "p99 us"):
            table.add_column(col)
        for label in ("hybridkv", "static_baseline"):
            r = res[label]
            first = True
            for op, s in r["ops"].items():
                table.add_row(
                    label if first else "",
                    f"{r['calls']:,}" if first else "",
                    f"{r['calls_per_s']:,.0f}" if first else "",
                    str(r["host_syncs"]) if first else "",
                    op,
                    f"{s['p50_us']:.1f}",
                    f"{s['p99_us']:.1f}",
                )
                first = False
        console.print(table)
        console.print(f"  hybridkv / baseline calls/s: [bold]{res['speedup_vs_baseline']:.2f}x[/]")
