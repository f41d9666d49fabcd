"""Per-request transfer status and per-leg status, both of which only move forward.

A *leg* is one (prefill rank, decode rank) part of a request. ``LegStatus`` is what a
prefill rank reports on the wire and what either side records per leg.

Invariants:
- ``Bootstrapping < WaitingForInput < Transferring < Success``; ``Failed`` is reachable from
  every non-terminal phase. A move backwards, or out of ``Success``/``Failed``, is refused
  (``advance`` returns False) and changes nothing: a late or duplicate message can never
  revive or downgrade a finished request.
- ``Success`` is reachable only from ``Transferring``: nothing is reported done that was
  never seen in flight.
- A failed request always carries a non-empty reason.
- ``timeline`` records every phase the request entered, in order, with its time since the
  request started (the first entry is ``Bootstrapping`` at 0).
- A leg goes ``Asked < Transferring < Success``, or to ``Failed`` from any non-terminal
  status (``LegStatus.can_enter``); nothing leaves ``Success`` or ``Failed``.
- ``ReportBoard`` keeps the latest report of every live request and of the most recent
  ``keep`` finished ones (older finished reports are dropped, so a long run stays bounded).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import IntEnum, StrEnum


class Phase(IntEnum):
    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4

    @property
    def terminal(self) -> bool:
        return self >= Phase.SUCCESS

    @property
    def label(self) -> str:
        return {
            Phase.BOOTSTRAPPING: "Bootstrapping",
            Phase.WAITING_FOR_INPUT: "WaitingForInput",
            Phase.TRANSFERRING: "Transferring",
            Phase.SUCCESS: "Success",
            Phase.FAILED: "Failed",
        }[self]


class LegStatus(StrEnum):
    """One leg of a request (values as on the wire)."""

    ASKED = "asked"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (LegStatus.SUCCESS, LegStatus.FAILED)

    def can_enter(self, status: LegStatus) -> bool:
        """Whether a leg at this status may move to ``status`` (forward only)."""
        return not self.terminal and _LEG_ORDER[status] > _LEG_ORDER[self]


_LEG_ORDER = {LegStatus.ASKED: 0, LegStatus.TRANSFERRING: 1, LegStatus.SUCCESS: 2, LegStatus.FAILED: 2}

LegReport = tuple[tuple[str, LegStatus], ...]  # (peer rank, its leg's status), per leg


@dataclass(frozen=True)
class StatusReport:
    """A snapshot of one request's status, safe to hand to another thread."""

    request_id: str
    phase: Phase
    reason: str
    nbytes: int
    ops: int
    elapsed_s: float
    timeline: tuple[tuple[Phase, float], ...] = ()  # (phase entered, seconds since start)
    legs: LegReport = ()
    finished_at: float | None = None  # time.monotonic() when it became terminal (None: not yet)

    def leg(self, rank: str) -> LegStatus | None:
        """The status of the leg with peer ``rank`` (None if there is none)."""
        return next((s for r, s in self.legs if r == rank), None)


class RequestStatus:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.phase = Phase.BOOTSTRAPPING
        self.reason = ""
        self.started = time.monotonic()
        self.finished: float | None = None
        self.nbytes = 0
        self.ops = 0
        self.timeline: list[tuple[Phase, float]] = [(Phase.BOOTSTRAPPING, 0.0)]

    def _enter(self, phase: Phase) -> None:
        now = time.monotonic()
        self.phase = phase
        self.timeline.append((phase, now - self.started))
        if phase.terminal:
            self.finished = now

    @property
    def terminal(self) -> bool:
        return self.phase.terminal

    def advance(self, phase: Phase) -> bool:
        """Move forward to ``phase`` (not ``Failed``: use ``fail``); False if refused."""
        if phase is Phase.FAILED:
            raise ValueError("use fail(reason) to fail a request")
        if self.terminal or phase <= self.phase:
            return False
        if phase is Phase.SUCCESS and self.phase is not Phase.TRANSFERRING:
            return False
        self._enter(phase)
        return True

    def fail(self, reason: str) -> bool:
        """Fail with ``reason`` unless already terminal; False if refused."""
        if self.terminal:
            return False
        self.reason = reason or "failed without a reason (bug)"
        self._enter(Phase.FAILED)
        return True

    def report(self, legs: LegReport = ()) -> StatusReport:
        end = self.finished if self.finished is not None else time.monotonic()
        elapsed = end - self.started
        return StatusReport(
            self.request_id,
            self.phase,
            self.reason,
            self.nbytes,
            self.ops,
            elapsed,
            tuple(self.timeline),
            legs,
            self.finished,
        )


class ReportBoard:
    """Thread-safe latest ``StatusReport`` per request: the I/O thread writes, anyone reads."""

    def __init__(self, keep: int = 10000) -> None:
        self.keep = keep
        self._reports: OrderedDict[str, StatusReport] = OrderedDict()
        self._finished = 0
        self._lock = threading.Lock()

    def publish(self, status: RequestStatus, legs: LegReport = ()) -> None:
        report = status.report(legs)
        with self._lock:
            old = self._reports.pop(report.request_id, None)
            self._finished -= old is not None and old.phase.terminal
            self._reports[report.request_id] = report
            self._finished += report.phase.terminal
            while self._finished > self.keep:
                rid = next(r for r, rep in self._reports.items() if rep.phase.terminal)
                del self._reports[rid]
                self._finished -= 1

    def get(self, request_id: str) -> StatusReport | None:
        with self._lock:
            return self._reports.get(request_id)
