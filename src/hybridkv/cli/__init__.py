"""Command-line interface. Each ``*_cmd`` module registers its commands on import."""

from hybridkv.cli import (  # noqa: F401
    bench_engine_cmd,
    bench_memory_cmd,
    demo_cmd,
    generate_cmd,
    pd_demo_cmd,
    plan_cmd,
    replay_cmd,
    transfer_cmd,
)
from hybridkv.cli.app import app, main

__all__ = ["app", "main"]
