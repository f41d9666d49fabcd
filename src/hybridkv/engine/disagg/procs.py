"""EngineProcs: one engine's worker processes, in a ``torch.distributed`` world of their own.

``EngineProcs(name, main, size, args, timeout_s, logs, names, threads)`` starts ``size``
processes, each running ``threads`` intra-op threads (``parallel.cpu_share``); process ``r``
joins a world of ``size`` ranks (gloo on CPU) through a ``TCPStore`` the launcher itself serves
on 127.0.0.1 at a port the OS gave it (held from before the first start: no other world can
take it between choosing and binding), and runs ``main(r, conn, *args)`` where ``conn`` is its
end of a duplex pipe to the launcher. Two engines never share a world, so a death in one never
breaks a collective of the other.

Processes come from the engine forkserver (``parallel.forkserver``: torch, transformers' config
classes and the worker modules imported once): a launch or a restart forks a ready interpreter
instead of importing them again in every worker.

Invariants:
- A worker's fd 2 is the write end of its pipe in ``logs`` (``WorkerLog``): the launcher reads
  what it writes there, whatever wrote it (Python or a C++ library).
- A worker that raises sends ``Crash`` (its traceback) on its pipe and exits with code 1; one
  whose launcher dies exits by itself (``watch_launcher``). A worker exits at once when its main
  returns (``os._exit`` after closing its world and pipe: no interpreter finalization).
- ``close`` asks nothing: it gives each process ``grace_s`` to exit, then terminates, then
  kills, and joins every one of them; afterwards no process of the engine is alive and every
  pipe end of the launcher is closed. ``kill`` sends a real signal to one rank.
- ``exit_reason`` joins a process (bounded) before it reads its exit code: a process whose
  sentinel fired is reported by how it ended, never as still running while it is exiting.
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

import torch
import torch.distributed as dist

from hybridkv.engine.disagg.protocol import Command, Crash
from hybridkv.engine.disagg.worker_log import WorkerLog
from hybridkv.engine.parallel.forkserver import context, watch_launcher
from hybridkv.engine.parallel.groups import backend_for

EXIT_WAIT_S = 5.0
"""How long ``exit_reason`` waits for a process whose sentinel fired to be reaped."""


def _child(
    main: Callable[..., None],
    rank: int,
    size: int,
    port: int,
    timeout_s: float,
    threads: int,
    conn: Connection,
    log: Connection,
    args: tuple[Any, ...],
) -> None:
    os.dup2(log.fileno(), 2)  # everything written to fd 2 goes to the launcher's WorkerLog
    log.close()
    threading.Thread(target=watch_launcher, daemon=True, name="launcher-watch").start()
    code = 0
    torch.set_num_threads(threads)
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
        self,
        name: str,
        main: Callable[..., None],
        size: int,
        args: tuple[Any, ...],
        timeout_s: float,
        logs: WorkerLog,
        names: list[str],
        threads: int,
    ) -> None:
        ctx = context()
        self.store: dist.TCPStore | None = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = self.store.port
        self.name = name
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        try:
            for rank in range(size):
                mine, theirs = ctx.Pipe(duplex=True)
                log = logs.pipe(names[rank])
                proc = ctx.Process(
                    target=_child,
                    args=(main, rank, size, port, timeout_s, threads, theirs, log, args),
                    name=f"hybridkv-{name}-{rank}",
                )
                try:
                    proc.start()
                finally:
                    theirs.close()
                    log.close()
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

    def exit_reason(self, rank: int) -> str:
        """How rank ``rank`` ended (``exit_reason``), once its sentinel fired."""
        return exit_reason(self.procs[rank])

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


def exit_reason(proc: Any, wait_s: float = EXIT_WAIT_S) -> str:
    """``exit code 1`` or ``killed by SIGKILL`` for a process that ended, joined first (at most ``wait_s``:
    its sentinel can fire a moment before its exit code can be read); ``still running`` only if it did not end."""
    proc.join(wait_s)
    code = proc.exitcode
    if code is None:
        return f"still running after {wait_s:.0f} s"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
