"""Deliberate faults of the PD server (demos and tests): which request, which rank, and the named hooks where
the router and a prefill worker apply them.

A ``Fault`` names a drill (its ``kind``, a name in ``FAULTS``) and a request by its submission index. The router
(``FaultPlan``) tells the prefill engine of it (``on_dispatch``), kills a decode rank at the request's first token
(``on_first``) or a prefill stage's rank as it starts sending (``on_sending``); a prefill worker raises while it
computes the request (``on_compute``) or holds or slows its hand-off (``on_hand_off``), with its writes throttled
from the start where a drill ``slows_writes``. Each hook asks the fault's drill, and ``PDConfig`` checks a fault's
rank against the ranks its drill's ``target`` names: nothing else in the server names a fault kind.

Adding a drill: a frozen ``Drill`` subclass that overrides the hooks it acts in (the others do nothing) and sets
its ``target``, plus one ``FAULTS.add`` line; ``--fault`` and ``PDConfig`` read it by its name. Only the router and
the prefill workers have hooks: a drill that acts inside a decode worker (stall a decode step, drop a received
page) needs a decode-side hook, which does not exist yet.

Invariants: a fault hits only its request; crash-prefill hits every attempt of it (a poison request), the
others only its first (a request run again after an engine restart runs clean); a stage's fault acts on the
stage's first TP rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from hybridkv.registry import Registry


class Target(Enum):
    """Which ranks a fault's ``rank`` names, as the ``PDConfig`` field that counts them."""

    PREFILL_STAGE = "prefill_pp"
    DECODE_RANK = "decode_tp"
    NONE = "none"  # the drill ignores ``rank``


@dataclass(frozen=True)
class HandOff:
    hold_s: float = 0.0  # stall-transfer: hand the request's KV to the sender this much later
    write_delay_s: float | None = None  # kill-prefill: this worker's delay per write (None: leave it as it is)


@dataclass(frozen=True)
class Drill:
    """One kind of deliberate fault: its target and the hooks it acts in (each one a no-op here)."""

    target: ClassVar[Target] = Target.PREFILL_STAGE
    slows_writes: ClassVar[bool] = False
    """A prefill worker's writes are throttled from its start, so that the drill can slow them."""

    def on_dispatch(self, attempt: int) -> bool:
        """Whether the prefill engine is told of the fault on this attempt of its request (the first)."""
        return attempt == 1

    def on_first(self, fault: Fault) -> int | None:
        """The decode rank to kill when the request's first token arrives (its first attempt)."""
        return None

    def on_sending(self, fault: Fault, prefill_tp: int, rank: int) -> bool:
        """Whether prefill worker ``rank`` is killed as it starts sending the request's KV (its first attempt)."""
        return False

    def on_compute(self, fault: Fault, prefill_tp: int, rank: int, tid: str) -> None:
        """Act while prefill worker ``rank`` computes the request."""

    def on_hand_off(self, fault: Fault, prefill_tp: int, rank: int) -> HandOff:
        """How prefill worker ``rank`` hands the request's KV to its sender."""
        return HandOff()


@dataclass(frozen=True)
class KillPrefill(Drill):
    """Prefill stage ``rank`` (TP rank 0) is SIGKILLed while it transfers the request; its writes are slowed by
    ``delay_s`` each so that the kill lands mid-transfer."""

    slows_writes: ClassVar[bool] = True

    def on_sending(self, fault: Fault, prefill_tp: int, rank: int) -> bool:
        return fault.hits(prefill_tp, rank)

    def on_hand_off(self, fault: Fault, prefill_tp: int, rank: int) -> HandOff:
        return HandOff(write_delay_s=fault.delay_s if fault.hits(prefill_tp, rank) else 0.0)


@dataclass(frozen=True)
class KillDecode(Drill):
    """Decode TP rank ``rank`` is SIGKILLed as soon as the request has its first token (the decode engine holds
    it). The router applies it: the prefill engine is never told."""

    target: ClassVar[Target] = Target.DECODE_RANK

    def on_dispatch(self, attempt: int) -> bool:
        return False

    def on_first(self, fault: Fault) -> int | None:
        return fault.rank


@dataclass(frozen=True)
class StallTransfer(Drill):
    """Every prefill rank holds the request's KV for ``delay_s`` before sending it, so that the decode side's
    ``transfer_timeout_s`` expires first."""

    target: ClassVar[Target] = Target.NONE

    def on_hand_off(self, fault: Fault, prefill_tp: int, rank: int) -> HandOff:
        return HandOff(hold_s=fault.delay_s)


@dataclass(frozen=True)
class CrashPrefill(Drill):
    """Prefill stage ``rank`` (TP rank 0) raises while it computes the request, on every attempt (a poison
    request: the router quarantines it)."""

    def on_dispatch(self, attempt: int) -> bool:
        return True

    def on_compute(self, fault: Fault, prefill_tp: int, rank: int, tid: str) -> None:
        if fault.hits(prefill_tp, rank):
            raise RuntimeError(f"deliberate fault {fault.kind}: prefill stage {fault.rank} computes {tid}")


FAULTS = Registry[Drill]("fault")
"""Every drill by the name ``--fault`` and ``Fault.kind`` give it."""
FAULTS.add("kill-prefill", KillPrefill())
FAULTS.add("kill-decode", KillDecode())
FAULTS.add("stall-transfer", StallTransfer())
FAULTS.add("crash-prefill", CrashPrefill())


@dataclass(frozen=True)
class Fault:
    kind: str  # a name in FAULTS
    request: int  # index of the submitted request (0-based, in submission order) it hits
    rank: int = 0  # the rank its drill's target names (a PP stage, a decode TP rank, or none)
    delay_s: float = 1.0  # what its drill waits (kill-prefill: per write; stall-transfer: how long the KV is held)

    def __post_init__(self) -> None:
        if self.kind not in FAULTS:
            raise ValueError(f"unknown fault {self.kind!r}; known: {', '.join(FAULTS)}")
        if self.request < 0:
            raise ValueError(f"fault '{self.kind}': request {self.request} is negative; use a submission index >= 0")
        if self.rank < 0:
            raise ValueError(f"fault '{self.kind}': rank {self.rank} is negative; use a rank >= 0")
        if self.delay_s < 0:
            raise ValueError(f"fault '{self.kind}': delay_s {self.delay_s} is negative; use a delay >= 0")

    @property
    def drill(self) -> Drill:
        return FAULTS[self.kind]

    @property
    def target(self) -> Target:
        """Which ranks ``rank`` names (``PDConfig`` checks it against their count)."""
        return self.drill.target

    def hits(self, prefill_tp: int, rank: int) -> bool:
        """Whether this prefill worker rank is the one a stage's fault acts on (the stage's first TP rank)."""
        return rank == self.rank * prefill_tp


class FaultPlan:
    """The router's side: the server's faults by request."""

    def __init__(self, faults: Sequence[Fault], prefill_tp: int) -> None:
        self._by_request = {f.request: f for f in faults}
        self.prefill_tp = prefill_tp

    def _first_attempt(self, index: int, attempt: int) -> Fault | None:
        return self._by_request.get(index) if attempt == 1 else None

    def on_dispatch(self, index: int, attempt: int) -> Fault | None:
        """The fault the prefill engine is told of with this attempt of request ``index`` (``Prefill.fault``)."""
        fault = self._by_request.get(index)
        return fault if fault is not None and fault.drill.on_dispatch(attempt) else None

    def on_first(self, index: int, attempt: int) -> int | None:
        """The decode rank to kill when the request's first token arrives (kill-decode), if any."""
        fault = self._first_attempt(index, attempt)
        return None if fault is None else fault.drill.on_first(fault)

    def on_sending(self, index: int, attempt: int, rank: int) -> bool:
        """Whether prefill worker ``rank`` is killed now, as it starts sending the request's KV (kill-prefill)."""
        fault = self._first_attempt(index, attempt)
        return fault is not None and fault.drill.on_sending(fault, self.prefill_tp, rank)


def slows_writes(faults: Sequence[Fault]) -> bool:
    """Whether a prefill worker's writes are throttled from its start (kill-prefill: the kill lands mid-transfer)."""
    return any(f.drill.slows_writes for f in faults)


def on_compute(fault: Fault | None, prefill_tp: int, rank: int, tid: str) -> None:
    """The fault's drill acts while prefill worker ``rank`` computes the request (crash-prefill raises)."""
    if fault is not None:
        fault.drill.on_compute(fault, prefill_tp, rank, tid)


def on_hand_off(fault: Fault | None, prefill_tp: int, rank: int) -> HandOff:
    """How prefill worker ``rank`` hands the request's KV to its sender: held back (stall-transfer), writes slowed
    (kill-prefill), or as usual."""
    return HandOff() if fault is None else fault.drill.on_hand_off(fault, prefill_tp, rank)
