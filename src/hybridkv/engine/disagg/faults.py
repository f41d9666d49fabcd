"""Deliberate faults of the PD server (demos and tests): which request, which rank, and the named hooks where
the router and a prefill worker apply them.

A ``Fault`` names a request by its submission index. The router (``FaultPlan``) tells the prefill engine of it
(``on_dispatch``), kills a decode rank at the request's first token (``on_first``) or a prefill stage's rank as
it starts sending (``on_sending``); a prefill worker raises while it computes the request (``on_compute``) or
holds or slows its hand-off (``on_hand_off``). Nothing else in the server names a fault kind.

Invariants: a fault hits only its request; crash-prefill hits every attempt of it (a poison request), the
others only its first (a request run again after an engine restart runs clean); a stage's fault acts on the
stage's first TP rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class FaultKind(StrEnum):
    KILL_PREFILL = "kill-prefill"
    KILL_DECODE = "kill-decode"
    STALL_TRANSFER = "stall-transfer"
    CRASH_PREFILL = "crash-prefill"


FAULT_KINDS = tuple(k.value for k in FaultKind)


@dataclass(frozen=True)
class Fault:
    kind: FaultKind | str  # a FaultKind or its name (stored as the FaultKind)
    request: int  # index of the submitted request (0-based, in submission order) it hits
    rank: int = 0  # kill-prefill, crash-prefill: the PP stage; kill-decode: the decode TP rank
    delay_s: float = 1.0  # kill-prefill: per write; stall-transfer: how long the KV is held back

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; known: {', '.join(FAULT_KINDS)}")
        object.__setattr__(self, "kind", FaultKind(self.kind))  # its str() is its name: messages say kill-decode
        if self.request < 0:
            raise ValueError(f"fault '{self.kind}': request {self.request} is negative; use a submission index >= 0")
        if self.rank < 0:
            raise ValueError(f"fault '{self.kind}': rank {self.rank} is negative; use a rank >= 0")
        if self.delay_s < 0:
            raise ValueError(f"fault '{self.kind}': delay_s {self.delay_s} is negative; use a delay >= 0")

    def sent_to_prefill(self, attempt: int) -> bool:
        """Whether the prefill engine is told of it on this attempt of its request: crash-prefill on
        every attempt, kill-prefill and stall-transfer on the first; kill-decode never (the router
        applies it, at the first token)."""
        return self.kind is FaultKind.CRASH_PREFILL or (self.kind is not FaultKind.KILL_DECODE and attempt == 1)

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
        return fault if fault is not None and fault.sent_to_prefill(attempt) else None

    def on_first(self, index: int, attempt: int) -> int | None:
        """kill-decode: the decode rank to kill when the request's first token arrives."""
        fault = self._first_attempt(index, attempt)
        return fault.rank if fault is not None and fault.kind is FaultKind.KILL_DECODE else None

    def on_sending(self, index: int, attempt: int, rank: int) -> bool:
        """kill-prefill: whether prefill worker ``rank`` is killed now, as it starts sending the request's KV."""
        fault = self._first_attempt(index, attempt)
        return fault is not None and fault.kind is FaultKind.KILL_PREFILL and fault.hits(self.prefill_tp, rank)


def slows_writes(faults: Sequence[Fault]) -> bool:
    """kill-prefill needs a prefill worker's writes slowed, so that the kill lands mid-transfer."""
    return any(f.kind is FaultKind.KILL_PREFILL for f in faults)


def on_compute(fault: Fault | None, prefill_tp: int, rank: int, tid: str) -> None:
    """crash-prefill: the stage's worker raises while it computes the request (every attempt)."""
    if fault is not None and fault.kind is FaultKind.CRASH_PREFILL and fault.hits(prefill_tp, rank):
        raise RuntimeError(f"deliberate fault crash-prefill: prefill stage {fault.rank} computes {tid}")


@dataclass(frozen=True)
class HandOff:
    hold_s: float = 0.0  # stall-transfer: hand the request's KV to the sender this much later
    write_delay_s: float | None = None  # kill-prefill: this worker's delay per write (None: leave it as it is)


def on_hand_off(fault: Fault | None, prefill_tp: int, rank: int) -> HandOff:
    """stall-transfer holds the request's KV back; kill-prefill slows the target stage's writes (others: none)."""
    if fault is not None and fault.kind is FaultKind.STALL_TRANSFER:
        return HandOff(hold_s=fault.delay_s)
    if fault is not None and fault.kind is FaultKind.KILL_PREFILL:
        return HandOff(write_delay_s=fault.delay_s if fault.hits(prefill_tp, rank) else 0.0)
    return HandOff()
