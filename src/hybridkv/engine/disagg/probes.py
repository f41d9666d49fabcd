"""Probes: ask every live worker what it holds now, and collect the answers of the latest probe only.

``Probes.start`` numbers a ``ProbeCall`` and sends ``Probe(seq)`` to every live engine (its world
rank 0 broadcasts it; every rank answers ``Live`` with that seq); ``answer`` files a ``Live``
under the open call. Invariant: an answer to an earlier (timed-out) probe is dropped, and the
call completes (``done``) once every rank of the engines it asked answered, sorted prefill first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.engine.disagg.protocol import Command, Live, Probe
from hybridkv.engine.disagg.results import WorkerState


class _Procs(Protocol):
    @property
    def pids(self) -> list[int]: ...


class _Engine(Protocol):
    names: list[str]
    epoch: int
    before: dict[int, tuple[int, int]]

    @property
    def procs(self) -> _Procs: ...

    @property
    def size(self) -> int: ...

    def leader(self, command: Command) -> None: ...


@dataclass
class ProbeCall:
    done: threading.Event = field(default_factory=threading.Event)
    states: list[WorkerState] = field(default_factory=list)
    expected: int = 0
    seq: int = 0  # echoed in every ``Live``: a late answer to an earlier probe is dropped


class Probes:
    def __init__(self) -> None:
        self.open: ProbeCall | None = None
        self.sent = 0  # probe sequence numbers handed out

    def start(self, call: ProbeCall, engines: list[_Engine]) -> None:
        call.expected = sum(e.size for e in engines)
        self.sent += 1
        call.seq = self.sent
        self.open = call  # an earlier, timed-out probe is dropped: its late answers carry its seq
        for e in engines:
            e.leader(Probe(call.seq))

    def answer(self, e: _Engine, rank: int, msg: Live) -> None:
        call = self.open
        if call is None or msg.seq != call.seq:
            return
        before = e.before.get(rank, (0, 0))
        call.states.append(
            WorkerState(e.names[rank], e.epoch, e.procs.pids[rank], before, msg.live, msg.requests, msg.threads)
        )
        if len(call.states) == call.expected:
            call.states.sort(key=lambda w: (not w.name.startswith("prefill"), w.name))
            self.open = None
            call.done.set()
