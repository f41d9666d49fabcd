"""The router's view of one engine epoch: its processes, their readiness, reports and crashes.

``launch(role, epoch, args)`` starts the prefill engine (PP x TP ``prefill_main`` processes)
or the decode engine (TP ``decode_main`` processes) as a new epoch, each its own
``torch.distributed`` world; ``await_ready`` blocks (bounded) until every worker of the given
engines said ``Ready``, raising ``PDStartError`` with the worker's traceback or exit reason.
Commands go to world rank 0 of an engine (``leader``), which broadcasts them to its peers.

Invariant: an engine that died is ``dead``; its processes are reaped by whoever marks it so.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from hybridkv.engine.disagg.config import WorkerArgs
from hybridkv.engine.disagg.decode_worker import decode_main
from hybridkv.engine.disagg.prefill_worker import prefill_main
from hybridkv.engine.disagg.procs import EngineProcs, exit_reason
from hybridkv.engine.disagg.protocol import Command, Crash, Ready, Report
from hybridkv.engine.disagg.results import PDRank
from hybridkv.engine.scheduler import Role
from hybridkv.transfer import TransferError


class PDStartError(TransferError):
    """An engine did not come up: the message holds its workers' tracebacks or exit codes."""


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

    def on_ready(self, rank: int, msg: Ready) -> None:
        self.ready.add(rank)
        self.shm[rank], self.before[rank] = msg.shm_path, msg.live

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


def launch(role: Role, epoch: int, args: WorkerArgs) -> EngineState:
    c = args.config
    if role is Role.PREFILL:
        procs = EngineProcs(args.engine, prefill_main, c.prefill_pp * c.prefill_tp, (args,), c.timeout_s)
        names = [f"prefill stage {s} TP rank {t}" for s in range(c.prefill_pp) for t in range(c.prefill_tp)]
    else:
        procs = EngineProcs(args.engine, decode_main, c.decode_tp, (args,), c.timeout_s)
        names = [f"decode TP rank {t}" for t in range(c.decode_tp)]
    return EngineState(role, epoch, procs, names)


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
                    raise PDStartError(f"{e.names[r]} failed to start:\n{msg.traceback}")
            elif obj in sentinels:
                e, r = sentinels[obj]
                code = e.procs.procs[r].exitcode
                raise PDStartError(f"{e.names[r]} died while starting ({exit_reason(code)})")
