"""Quarantine: which requests an engine death implicates, which are retried alone, which fail, and
which deaths count against an engine's restart budget.

The rule (``PDServer`` applies it at every death of an engine; "role": prefill or decode):
- A request is *present* at a death of the prefill engine if it was dispatched to that epoch and
  its KV/state had not landed on the decode side; at a death of the decode engine if it was
  reserved on that epoch (and had not ended).
- A death of an epoch that had *started* (every rank said Ready) implicates every open request
  present: each records it. A request that has recorded two deaths of the same role is
  *quarantined*: it fails alone ("quarantined: the prefill engine died twice while it held this
  request: <death>; <death>"). Every other request present becomes a *suspect*.
- Suspects are retried one at a time, alone: the router dispatches a suspect only when no other
  request is in flight, and dispatches nothing else while a suspect waits or runs (new requests
  queue). So a suspect's second death has it alone present: only the request whose processing
  kills an engine is quarantined, never the requests that shared the engine with it. (Cost: after
  a death, its requests are computed again one by one before new ones start.)
- Budget: a death counts against the role's ``restarts`` unless a request quarantined for that
  role's deaths was present at it; the engine is lost when a death brings the counted deaths of
  its role above ``restarts``. A poison request thus spends one restart at its first death and
  gives it back when it is quarantined at its second (``restarts=0``: the first death loses the
  engine, as before).
- A death of an epoch that had not started implicates no request (none was processed there): its
  requests go back to the front of the line they came from (a suspect stays a suspect), and the
  death counts.
Invariant: a request is quarantined at most once, and only at a death it was present at.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridkv.engine.sched.scheduler import Role

QUARANTINED = "quarantined"
"""How the reason of a quarantined request starts."""


@dataclass(frozen=True)
class Death:
    role: Role
    why: str  # the death line
    present: frozenset[int]  # the requests (submission indices) it implicates


class Quarantine:
    def __init__(self) -> None:
        self.deaths: list[Death] = []
        self.quarantined: set[int] = set()
        self._quarantined_by: dict[Role, set[int]] = {Role.PREFILL: set(), Role.DECODE: set()}  # role -> requests
        self.suspects: deque[int] = deque()  # submission indices, retried in this order, one at a time
        self.queue: deque[int] = deque()  # the other requests to dispatch, in order
        self._held: dict[tuple[int, Role], list[str]] = {}  # (request, role) -> the deaths it was present at

    def next(self, busy: bool) -> int | None:
        """The request to dispatch now: the first suspect, only when no request is in flight (not ``busy``);
        with no suspect left, the first queued request; None: nothing may go now."""
        if self.suspects:
            return None if busy else self.suspects.popleft()
        return self.queue.popleft() if self.queue else None

    def record(self, role: Role, why: str, present: list[int], started: bool) -> dict[int, str]:
        """Record a death of the ``role`` engine with the open requests ``present`` at it (implicated only if
        the epoch had ``started``). Returns the requests to fail, with their reasons (quarantined); the others
        implicated are queued as suspects, in submission order."""
        implicated = sorted(present) if started else []
        self.deaths.append(Death(role, why, frozenset(implicated)))
        failed: dict[int, str] = {}
        for index in implicated:
            seen = self._held.setdefault((index, role), [])
            seen.append(why)
            if len(seen) >= 2:
                self.quarantined.add(index)
                self._quarantined_by[role].add(index)
                failed[index] = (
                    f"{QUARANTINED}: the {role.value} engine died twice while it held this request: {'; '.join(seen)}"
                )
            elif index not in self.suspects:
                self.suspects.append(index)
        for index in failed:
            if index in self.suspects:
                self.suspects.remove(index)
        return failed

    def requeue(self, index: int) -> None:
        """Put a request that a death did not implicate back at the front of its line: the suspects' if it was
        present at an earlier death, else the queue's."""
        held = any(i == index for i, _ in self._held)
        (self.suspects if held else self.queue).appendleft(index)

    def counted(self, role: Role) -> int:
        """Deaths of the ``role`` engine that count against its restart budget (no request quarantined for
        deaths of that engine was present at them)."""
        explained = self._quarantined_by[role]
        return sum(1 for d in self.deaths if d.role is role and not d.present & explained)

    def clear(self) -> None:
        """Forget what waits (an engine is lost: every open request fails)."""
        self.suspects.clear()
        self.queue.clear()
