"""The router's view of one engine epoch: its processes, their readiness, reports and crashes.

``launch(role, epoch, args, logs)`` starts the prefill engine (PP x TP ``prefill_main``
processes) or the decode engine (TP ``decode_main`` processes) as a new epoch, each its own
``torch.distributed`` world; ``await_ready`` blocks (bounded) until every worker of the given
engines said ``Ready``, raising ``PDStartError``: "<worker> failed to start: <its exception
line>" (the whole traceback in ``.traceback``) or "<worker> died while starting (killed by
SIGKILL)". Commands go to world rank 0 of an engine (``leader``), which broadcasts them.

Invariants:
- An engine that died is ``dead``; its processes are reaped by whoever marks it so.
- ``shm`` names every session file the epoch's decode ranks may create (``WorkerArgs.shm_tokens``),
  from launch on: whoever ends an epoch, started or not, unlinks them all (``unlink_all``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from hybridkv.engine.disagg.config import WorkerArgs
from hybridkv.engine.disagg.decode_worker import decode_main
from hybridkv.engine.disagg.prefill_worker import prefill_main
from hybridkv.engine.disagg.procs import EngineProcs
from hybridkv.engine.disagg.protocol import Command, Crash, Event, Ready, Report, Stop, TierFigures
from hybridkv.engine.disagg.results import PDRank
from hybridkv.engine.disagg.worker_log import WorkerLog
from hybridkv.engine.parallel.cpu_share import worker_threads
from hybridkv.engine.sched.scheduler import Role
from hybridkv.transfer import TransferError
from hybridkv.transfer.shared import shm_path


class PDStartError(TransferError):
    """An engine did not come up: the message names the worker and why (its exception line or how it
    ended); ``traceback`` holds the worker's whole traceback when it raised."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback


@dataclass
class EngineState:
    role: Role
    epoch: int
    procs: EngineProcs
    names: list[str]
    ready: set[int] = field(default_factory=set)
    before: dict[int, tuple[int, int]] = field(default_factory=dict)
    shm: dict[int, str] = field(default_factory=dict)
    crash: dict[int, str] = field(default_factory=dict)
    reports: dict[int, Report] = field(default_factory=dict)
    figures: dict[int, dict[str, Any]] = field(default_factory=dict)  # a prefill rank's latest ``TierFigures``
    dead: bool = False

    @property
    def name(self) -> str:
        return f"pd-{self.role.value}-{self.epoch}"

    @property
    def size(self) -> int:
        return len(self.procs.conns)

    def leader(self, command: Command) -> None:
        """Send ``command`` to world rank 0 (it broadcasts to the others at its next step)."""
        self.procs.send(0, command)

    def retire(self) -> None:
        """A worker died: end every process now (its peers' collectives are broken) and unlink its
        shm files."""
        self.dead = True
        self.procs.close(0.0)
        unlink_all(self.shm.values())

    def stop(self, grace_s: float, tell: bool) -> None:
        """Reap every process, waiting ``grace_s`` for a live engine to stop by itself; ``tell``: send
        it ``Stop`` first (nobody else will: the router that would have is gone)."""
        if tell and not self.dead:
            self.leader(Stop())
        self.procs.close(0.0 if self.dead else grace_s)

    def on_ready(self, rank: int, msg: Ready) -> None:
        self.ready.add(rank)
        self.shm[rank], self.before[rank] = msg.shm_path, msg.live

    def record(self, rank: int, msg: Event) -> bool:
        """File what a worker says about itself (``Ready``, ``Report``, ``Crash``, ``TierFigures``);
        False for any other event (the router's to handle)."""
        if isinstance(msg, Ready):
            self.on_ready(rank, msg)
        elif isinstance(msg, Report):
            self.reports[rank] = msg
        elif isinstance(msg, Crash):
            self.crash[rank] = msg.traceback
        elif isinstance(msg, TierFigures):
            self.figures[rank] = msg.figures
        else:
            return False
        return True

    def ranks(self, prefill_tp: int) -> list[PDRank]:
        """What each worker that stopped cleanly reported."""
        out = []
        for r, rep in sorted(self.reports.items()):
            index, within = divmod(r, prefill_tp) if self.role is Role.PREFILL else (r, r)
            out.append(
                PDRank(
                    self.role.value,
                    index,
                    within,
                    self.epoch,
                    self.procs.pids[r],
                    rep.live_before,
                    rep.live_after,
                    rep.transfer_bytes,
                    rep.requests,
                )
            )
        return out


def unlink_all(paths: Iterable[str]) -> None:
    """Remove each file (shared-memory arenas of dead or stopped workers) that still exists."""
    for path in paths:
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def launch(role: Role, epoch: int, args: WorkerArgs, logs: WorkerLog) -> EngineState:
    c = args.config
    threads = worker_threads(c.prefill_pp * c.prefill_tp + c.decode_tp)  # both engines share this host
    if role is Role.PREFILL:
        names = [f"prefill stage {s} TP rank {t}" for s in range(c.prefill_pp) for t in range(c.prefill_tp)]
        procs = EngineProcs(args.engine, prefill_main, len(names), (args,), c.timeout_s, logs, names, threads)
    else:
        names = [f"decode TP rank {t}" for t in range(c.decode_tp)]
        procs = EngineProcs(args.engine, decode_main, len(names), (args,), c.timeout_s, logs, names, threads)
    shm = {rank: shm_path(token) for rank, token in enumerate(args.shm_tokens)}
    return EngineState(role, epoch, procs, names, shm=shm)


def engine_name(role: Role, epoch: int) -> str:
    """The bootstrap name of an engine epoch."""
    return f"pd-{role.value}-{epoch}"


def await_ready(engines: list[EngineState], timeout_s: float) -> None:
    """Block until every worker said Ready; ``PDStartError`` (with tracebacks) if one crashed or died."""
    end = time.monotonic() + timeout_s
    while any(len(e.ready) < e.size for e in engines):
        objs = {c: (e, r) for e in engines for r, c in enumerate(e.procs.conns) if r not in e.ready}
        sentinels = {p.sentinel: (e, r) for e in engines for r, p in enumerate(e.procs.procs)}
        left = end - time.monotonic()
        got = wait(list(objs) + list(sentinels), timeout=max(0.0, left))
        if left <= 0:
            raise PDStartError(f"workers not ready within {timeout_s:.0f} s")
        for obj in got:
            if obj in objs:
                e, r = objs[obj]
                try:
                    msg = obj.recv()
                except EOFError:
                    continue
                if isinstance(msg, Ready):
                    e.on_ready(r, msg)
                elif isinstance(msg, Crash):
                    raise PDStartError(f"{e.names[r]} failed to start: {crash_line(msg.traceback)}", msg.traceback)
            elif obj in sentinels:
                e, r = sentinels[obj]
                crash = _last_crash(e, r)
                if crash:
                    raise PDStartError(f"{e.names[r]} failed to start: {crash_line(crash)}", crash)
                raise PDStartError(f"{e.names[r]} died while starting ({e.procs.exit_reason(r)})")


def crash_line(traceback: str) -> str:
    """The exception line of a worker's traceback (its last non-empty line)."""
    lines = [line for line in traceback.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no traceback)"


def _last_crash(e: EngineState, r: int) -> str:
    """The ``Crash`` a worker whose sentinel fired sent before it exited, if any."""
    conn = e.procs.conns[r]
    crash = ""
    with contextlib.suppress(EOFError, OSError):
        while conn.poll(0):
            msg = conn.recv()
            if isinstance(msg, Crash):
                crash = msg.traceback
            elif isinstance(msg, Ready):
                e.on_ready(r, msg)
    return crash
