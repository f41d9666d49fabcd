"""``hybridkv pd-demo``: a real prefill->decode transfer, prefill PP stages as separate processes."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hybridkv.cli.app import app
from hybridkv.cli.params import TRANSPORT_CHOICES, transport_option
from hybridkv.units import format_bytes

MAX_REQUESTS = 8
"""Good requests per model: every decode arena holds all of them at once until the byte check."""


@contextlib.contextmanager
def quiet_transfer_log() -> Iterator[None]:
    """Keep the transfer agents' warnings (the demo's deliberate faults) off stderr: the
    report shows every failure with its reason."""
    logger = logging.getLogger("hybridkv.transfer")
    handler = logging.NullHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def print_pd_report(console: Console, report: dict[str, Any]) -> None:
    """The per-request table, the failure reasons and the checks of a ``run_pd_demo`` report."""
    table = Table(
        title=f"{', '.join(report['models'])} over {report['transport']}: prefill PP {report['prefill']['pp']} "
        f"({report['prefill']['processes']} processes) -> decode TP {report['decode']['tp']}"
    )
    for col in ("request", "decode rank", "status timeline (ms since the request)", "bytes", "ops", "time", "GB/s"):
        table.add_column(col, justify="right" if col in ("bytes", "ops", "time", "GB/s") else "left")
    for r in report["requests"]:
        table.add_row(
            escape(r["id"]),
            escape(r["decode"].removeprefix(f"decode:{r['model']}")),
            " → ".join(f"{label} {t:.1f}" for label, t in r["timeline_ms"]),
            format_bytes(r["bytes"]),
            str(r["ops"]),
            f"{r['time_ms']:.1f} ms",
            f"{r['gbps']:.3g}",
        )
    console.print(table)
    for r in report["requests"]:
        if r["reason"]:
            where = f"{r['id']} on {r['decode']}"
            console.print(f"  [red]{r['phase']}[/red] {escape(where)}: {escape(r['reason'])}")
    for check in report["checks"]:
        mark = "[green]ok[/green]" if check["ok"] else f"[red]FAILED[/red] ({escape(check['error'])})"
        console.print(f"  {mark}  {escape(check['check'])}")
    console.print(
        f"{'all checks passed' if report['ok'] else 'SOME CHECKS FAILED'}: {format_bytes(report['bytes_verified'])} "
        f"transferred and compared byte for byte; start-up {report['startup_s']:.1f} s, transfers "
        f"{report['transfer_s'] * 1e3:.0f} ms, total {report['total_s']:.1f} s"
    )


@app.command("pd-demo")
def pd_demo(
    transport: str = typer.Option("shm", "--transport", help=f"{TRANSPORT_CHOICES}.", callback=transport_option),
    model: list[str] = typer.Option(None, "--model", help="Tiny hybrid preset(s); default tiny-swa2-state, tiny-gdn."),
    requests: int = typer.Option(3, "--requests", help="Good requests per model.", min=1, max=MAX_REQUESTS),
    decode_tp: int = typer.Option(2, "--decode-tp", help="Decode TP ranks (in this process).", min=1, max=4),
    fault: list[str] = typer.Option(None, "--fault", help="slot-size and/or seq-len (default both); 'none' for none."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Prefill PP stages in separate processes -> decode TP ranks: status, bytes, GB/s, every byte checked.

    A fresh random cluster key authenticates the run's control plane (the stage processes
    get it in their environment)."""
    from hybridkv.testing.pd_demo import FAULTS, MODELS, run_pd_demo

    faults = FAULTS if not fault else tuple(f for f in fault if f != "none")
    with quiet_transfer_log():
        report = run_pd_demo(transport, tuple(model) if model else MODELS, requests, decode_tp, faults)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        print_pd_report(Console(width=160), report)
    if not report["ok"]:
        raise typer.Exit(1)
