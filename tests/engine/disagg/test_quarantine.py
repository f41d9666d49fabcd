"""The quarantine rule alone (``engine.disagg.quarantine``), step by step; the real crash is in test_disagg_faults.

- Every request present at a started epoch's death becomes a suspect, in submission order; suspects go
  one at a time and only when nothing is in flight, the queue only once no suspect is left.
- A request present at a second death of the same role is quarantined with both death lines; a death of
  the other role does not count towards it.
- Budget: every death counts until a quarantined request explains it (then both of that request's deaths
  stop counting); a death of an epoch that had not started implicates nothing, counts, and sends its
  requests back to the front of their own line.
"""

from __future__ import annotations

from hybridkv.engine.disagg.quarantine import Quarantine
from hybridkv.engine.sched.scheduler import Role

P, D = Role.PREFILL, Role.DECODE


def test_suspects_go_alone_and_before_the_queue() -> None:
    q = Quarantine()
    q.queue.extend([7, 8])
    assert q.record(P, "death 1", [5, 2, 3], started=True) == {}
    assert list(q.suspects) == [2, 3, 5]
    assert q.next(busy=True) is None  # something in flight: the suspect waits, and so does the queue
    assert q.next(busy=False) == 2
    assert q.next(busy=True) is None  # suspect 2 runs alone
    assert [q.next(busy=False), q.next(busy=False)] == [3, 5]
    assert [q.next(busy=True), q.next(busy=True), q.next(busy=True)] == [7, 8, None]  # no suspect left


def test_a_second_death_of_the_same_engine_quarantines_and_gives_the_budget_back() -> None:
    q = Quarantine()
    assert q.record(P, "prefill death 1", [0, 1, 2], started=True) == {}
    assert q.counted(P) == 1
    assert q.record(D, "decode death 1", [1], started=True) == {}  # another engine: not the same story
    assert q.counted(D) == 1 and 1 not in q.quarantined
    for _ in range(3):
        q.next(busy=False)
    failed = q.record(P, "prefill death 2", [1], started=True)
    assert failed == {
        1: "quarantined: the prefill engine died twice while it held this request: prefill death 1; prefill death 2"
    }
    assert q.quarantined == {1} and 1 not in q.suspects
    assert q.counted(P) == 0  # both prefill deaths explained by request 1
    assert q.counted(D) == 1  # quarantined for prefill deaths: it explains no decode death
    assert q.record(P, "prefill death 3", [4], started=True) == {} and q.counted(P) == 1


def test_a_death_before_the_epoch_started_implicates_nothing_and_counts() -> None:
    q = Quarantine()
    q.record(P, "death 1", [3], started=True)
    assert q.next(busy=False) == 3
    assert q.record(P, "died starting", [3, 4], started=False) == {}
    assert q.counted(P) == 2 and not q.suspects and not q.quarantined
    q.requeue(4)
    q.requeue(3)  # a suspect stays a suspect: still alone, still one death from quarantine
    assert list(q.suspects) == [3] and list(q.queue) == [4]
    assert q.record(P, "death 3", [3], started=True) == {
        3: "quarantined: the prefill engine died twice while it held this request: death 1; death 3"
    }
    assert q.counted(P) == 1  # the death while starting is not explained by request 3
