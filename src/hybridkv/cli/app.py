"""The ``hybridkv`` command: typer apps that command modules register on."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="hybridkv: memory, prefix cache and PD transfer for hybrid LLMs.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks, side by side with a baseline in the same run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
