"""The forkserver every engine process comes from (disaggregated engines, ``parallel.launch``).

``context()`` is ``multiprocessing``'s forkserver context, its forkserver (one per launcher
process, started at the first call) having imported torch, transformers' config classes and the
engine's worker modules once (``PRELOAD``): a launch or a restart forks a ready interpreter
instead of importing them again in every worker. Fork safety: the forkserver runs no thread when
it forks (``forkserver_threads``; the one thread those imports start, numpy's OpenBLAS server, is
stopped by OpenBLAS itself before every fork), and everything with threads or sockets (gloo, the
transfer agents, Mooncake, whose import alone starts threads) is created in the worker, after the
fork. The forkserver's environment, and so the workers', is the launcher's at the first call.

Invariant: a worker that runs ``watch_launcher`` exits at once when its launcher is gone (the
launcher's end of its start pipe closes with it; a worker's parent is the forkserver, not the
launcher, so its parent id says nothing).
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import forkserver
from multiprocessing.connection import wait
from typing import Any

PRELOAD = ["hybridkv.engine.disagg.preload"]
"""What the forkserver imports once, before it forks any worker (see that module)."""


def context() -> Any:
    """The forkserver context every engine process comes from (preloading ``PRELOAD``)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def forkserver_pid() -> int | None:
    """The forkserver's process id, once one was started in this process."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def forkserver_threads() -> int:
    """Threads of the forkserver (1 when fork-safe; 0 when none runs)."""
    pid = forkserver_pid()
    if pid is None:
        return 0
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return 0


def watch_launcher() -> None:
    """Run in a daemon thread of a worker: exit at once when the launcher is gone."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])
    os._exit(1)
