"""What a decode rank tracks per incoming request: its sources, legs, reservation and quarantine.

``Allocation`` is what the owner reserved for a request (pages and a state slot: an engine
through its ``KVManager``, a rig through ``hybridkv.testing.reservations``). The receiver only
pins the ids and, once out of quarantine, hands a failed request's id back with
``take_releasable`` for the owner to free through its one free path: one owner, one free path,
on the product path and in every rig. ``Quarantine`` counts failed requests whose pages wait for
every writer to stop (thread-safe: the I/O thread writes, ``stats`` reads).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from hybridkv.transfer.agent import log
from hybridkv.transfer.liveness import gone
from hybridkv.transfer.messages import Rank, Register
from hybridkv.transfer.ops import TransferPlan
from hybridkv.transfer.plan import Route
from hybridkv.transfer.status import LegReport, LegStatus, RequestStatus

LIVENESS_CHECK_S = 0.1
"""How often a quarantined request's silent writers are checked for having exited."""


@dataclass(frozen=True)
class ReceiverStats:
    """What a decode rank holds and what it refused (``DecodeReceiver.stats``)."""

    held: int  # requests whose pages are held (in flight or quarantined)
    quarantined: int  # failed requests whose pages wait for their writers to stop
    quarantined_pages: int
    stuck: int  # quarantined longer than ``quarantine_s``: a writer neither answers nor exited
    auth_failures: int  # frames refused for their MAC, addressee or sequence (replays)
    rejected: int  # every refused message, auth failures included


@dataclass(frozen=True)
class Allocation:
    """What the owner reserved for a request on this decode rank: its pages and state slot."""

    pages: np.ndarray
    slot: int | None


@dataclass
class Source:
    """One registered prefill rank of a looked-up engine."""

    reg: Register
    route: Route
    last_seen: float = 0.0


@dataclass
class Leg:
    source: Source
    plan: TransferPlan  # destination-only: the bytes this rank must write here
    since: float  # when the request went out: silence counts from here at the earliest
    status: LegStatus = LegStatus.ASKED  # terminal once the prefill rank sent its last word
    checksum: int | None = None


@dataclass
class Incoming:
    status: RequestStatus
    engine: str
    seq_len: int
    dst_cells: dict[str, list[int]]
    checksum: bool
    nonce: int
    deadline: float
    legs: dict[Rank, Leg] = field(default_factory=dict)
    quarantine_until: float | None = None  # set when the request fails: from then on, quarantined
    next_check: float = 0.0  # when to ask again whether silent writers exited
    stuck: bool = False
    verifying: bool = False


def legs_report(inc: Incoming) -> LegReport:
    return tuple((str(rank), leg.status) for rank, leg in inc.legs.items())


class Quarantine:
    """Failed requests whose pages wait for their writers (pages per request, and the stuck ones)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: dict[str, int] = {}
        self._stuck: set[str] = set()

    def add(self, request_id: str, pages: int) -> None:
        with self._lock:
            self._pages[request_id] = pages

    def mark_stuck(self, request_id: str) -> None:
        with self._lock:
            self._stuck.add(request_id)

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._pages.pop(request_id, None)
            self._stuck.discard(request_id)

    def over(self, inc: Incoming, now: float, quarantine_s: float, who: str) -> bool:
        """Whether ``inc`` (failed) may release its pages now: every leg ended, or every silent
        writer's process is proven gone (checked every ``LIVENESS_CHECK_S``). Past ``quarantine_s``
        it is logged once and counted stuck; its pages stay reserved."""
        if inc.quarantine_until is None:
            return False
        rid = inc.status.request_id
        silent = [g.source.reg for g in inc.legs.values() if not g.status.terminal]
        if silent:
            if now < inc.next_check:
                return False
            inc.next_check = now + LIVENESS_CHECK_S
            alive = [reg for reg in silent if not gone(reg.process)]
            if alive:
                if now > inc.quarantine_until and not inc.stuck:
                    inc.stuck = True
                    self.mark_stuck(rid)
                    log.warning(
                        "%s: %s still quarantined after %.1f s: prefill %s neither acknowledged stop nor "
                        "exited; its pages stay reserved",
                        who,
                        rid,
                        quarantine_s,
                        ", ".join(str(reg.rank) for reg in alive),
                    )
                return False
            log.info("%s: %s: every silent writer exited; releasing its pages", who, rid)
        inc.quarantine_until = None
        self.remove(rid)
        return True

    def counts(self) -> tuple[int, int, int]:
        """(quarantined requests, their pages, stuck requests)."""
        with self._lock:
            return len(self._pages), sum(self._pages.values()), len(self._stuck)
