"""Command-line interface: one module per command group, each registering its commands on import.

``plan`` (plan, presets, transfer-plan), ``replay``, ``generate``, ``serve`` (HTTP), ``serve-pd``,
``bench`` (memory, cache, transfer, engine, serve), ``demo``, ``pd_demo``, ``vllm-pd-proxy``; ``app`` holds
the typer apps and the one error path (``main``); ``params`` the option checks shared by the commands.
"""

from hybridkv.cli import bench, demo, generate, pd_demo, plan, replay, serve, serve_pd, vllm_pd  # noqa: F401
from hybridkv.cli.app import app, main

__all__ = ["app", "main"]
