"""launch: run ``fn(rank, *args)`` in ``world_size`` processes joined into one ``torch.distributed`` world.

The processes come from the engine forkserver (``parallel.forkserver``: its imports done once).

Invariants:
- Every child runs its share of this host's CPUs as intra-op threads (``cpu_share``).
- Every child joins the world (``init_world``, backend from ``device``, TCP on 127.0.0.1 at a
  free port, with ``timeout_s`` on init and on every collective) before ``fn`` runs, and
  leaves it (``destroy_process_group``) after, whatever ``fn`` did.
- ``launch`` returns the children's results in rank order, or raises ``LaunchError`` (a
  child raised: every child's traceback) or ``LaunchTimeout`` (no result within
  ``timeout_s``); in every case, including an exception in the caller's thread, every child
  has been terminated (then killed) and joined before ``launch`` returns or raises: no
  orphans. A child whose launcher dies without reaping it (SIGKILL) exits by itself at once
  (``watch_launcher``).
- Results travel through a queue, so they must pickle; return plain data (lists, numpy),
  not tensors (a tensor's shared storage would outlive its child).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybridkv.engine.parallel.cpu_share import worker_threads
from hybridkv.engine.parallel.forkserver import context, watch_launcher
from hybridkv.engine.parallel.groups import DEFAULT_TIMEOUT_S, init_world


class LaunchError(RuntimeError):
    """A child process raised; the message holds every failing rank's traceback.

    ``pids``: the children's process ids (all of them reaped by the time this is raised).
    """

    pids: tuple[int, ...] = ()


class LaunchTimeout(LaunchError):
    """Not every child returned within the launch timeout."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    device: str,
    timeout_s: float,
    threads: int,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    threading.Thread(target=watch_launcher, daemon=True, name="launcher-watch").start()
    torch.set_num_threads(threads)
    try:
        init_world(rank, world_size, port, device, timeout_s)
        results.put((rank, True, fn(rank, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    device: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    collective_timeout_s: float | None = None,
) -> list[Any]:
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]``, each run in its own process.

    ``fn`` must be importable by name (a module-level function). ``timeout_s`` bounds the
    whole launch; ``collective_timeout_s`` (default: ``timeout_s``) each collective.
    """
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    coll = timeout_s if collective_timeout_s is None else collective_timeout_s
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, device, coll, worker_threads(world_size), args, results),
            name=f"hybridkv-rank{rank}",
        )
        for rank in range(world_size)
    ]
    finished = False
    try:
        for p in procs:
            p.start()
        out = _collect(procs, results, world_size, time.monotonic() + timeout_s, timeout_s)
        finished = True
        return out
    except LaunchError as exc:
        exc.pids = tuple(p.pid for p in procs if p.pid is not None)
        raise
    finally:
        _reap(procs, grace_s=5.0 if finished else 0.0)
        results.close()
        results.join_thread()


def _collect(procs: list[Any], results: Any, world_size: int, deadline: float, timeout_s: float) -> list[Any]:
    got: dict[int, Any] = {}
    errors: dict[int, str] = {}
    while len(got) + len(errors) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(world_size)) - set(got) - set(errors))
            raise LaunchTimeout(f"ranks {missing} returned nothing within {timeout_s:.0f} s" + _describe(errors))
        try:
            rank, ok, value = results.get(timeout=min(left, 0.5))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in got and i not in errors]
            if dead and results.empty():
                codes = {i: procs[i].exitcode for i in dead}
                raise LaunchError(
                    f"ranks {dead} exited without a result (exit codes {codes})" + _describe(errors)
                ) from None
            continue
        if ok:
            got[rank] = value
        else:
            errors[rank] = value
            break  # the others may now wait forever on the failed rank: stop them all
    if errors:
        raise LaunchError("a rank failed" + _describe(errors))
    return [got[r] for r in range(world_size)]


def _describe(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items()))


def _reap(procs: list[Any], grace_s: float) -> None:
    """Give every started child ``grace_s`` to exit, then terminate (then kill) it, and join it."""
    started = [p for p in procs if p.pid is not None]
    deadline = time.monotonic() + grace_s
    for p in started:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in started:
        if p.is_alive():
            p.terminate()
    for p in started:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join()
