"""Command-line interface. Each ``*_cmd`` module registers its commands on import."""

from hybridkv.cli import bench_memory_cmd, demo_cmd, pd_demo_cmd, plan_cmd, replay_cmd, transfer_cmd  # noqa: F401
from hybridkv.cli.app import app, main

__all__ = ["app", "main"]
