"""EngineProcs: one engine's worker processes, in a ``torch.distributed`` world of their own.

``EngineProcs(name, main, size, args)`` spawns ``size`` processes; process ``r`` joins a
world of ``size`` ranks (gloo on CPU) through a ``TCPStore`` the launcher itself serves on
127.0.0.1 at a port the OS gave it (held from before the first spawn: no other world can
take it between choosing and binding), and runs ``main(r, conn, *args)`` where ``conn`` is
its end of a duplex pipe to the launcher. Two engines never share a world, so a death in
one never breaks a collective of the other.

Invariants:
- A worker that raises sends ``Crash`` (its traceback) on its pipe and exits with code 1; one
  whose launcher dies exits by itself within a second (it watches its parent id). A worker
  exits at once when its main returns (``os._exit`` after closing its world and pipe: no
  interpreter finalization).
- ``close`` asks nothing: it gives each process ``grace_s`` to exit, then terminates, then
  kills, and joins every one of them; afterwards no process of the engine is alive and every
  pipe end of the launcher is closed. ``kill`` sends a real signal to one rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from hybridkv.engine.disagg.protocol import Command, Crash
from hybridkv.engine.parallel.groups import backend_for
from hybridkv.engine.parallel.launch import _exit_with_parent


def _child(
    main: Callable[..., None],
    rank: int,
    size: int,
    port: int,
    timeout_s: float,
    conn: Connection,
    parent: int,
    args: tuple[Any, ...],
) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="parent-watch").start()
    code = 0
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group(backend_for("cpu"), store=store, rank=rank, world_size=size, timeout=timeout)
        main(rank, conn, *args)
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(Crash(traceback.format_exc()))
        code = 1  # the launcher has the traceback: exit 1, print nothing
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
    # everything the worker owns is closed and reported: skip the interpreter's finalization, whose last
    # garbage collection over torch's and the model's objects takes seconds (a stop or restart waited for it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class EngineProcs:
    def __init__(
        self, name: str, main: Callable[..., None], size: int, args: tuple[Any, ...], timeout_s: float
    ) -> None:
        ctx = mp.get_context("spawn")
        self.store: dist.TCPStore | None = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = self.store.port
        self.name = name
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        try:
            for rank in range(size):
                mine, theirs = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_child,
                    args=(main, rank, size, port, timeout_s, theirs, os.getpid(), args),
                    name=f"hybridkv-{name}-{rank}",
                )
                proc.start()
                theirs.close()
                self.conns.append(mine)
                self.procs.append(proc)
        except BaseException:
            self.close(0.0)
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, rank: int, command: Command) -> None:
        """Send one command; a dead worker's broken pipe is ignored (its sentinel reports the death)."""
        with contextlib.suppress(OSError):
            self.conns[rank].send(command)

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)

    def close(self, grace_s: float) -> None:
        for p in self.procs:
            p.join(timeout=grace_s)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        self.store = None  # stops serving the world's rendezvous


def exit_reason(code: int | None) -> str:
    """``exit code 1`` or ``killed by SIGKILL`` for a process's exit code."""
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
