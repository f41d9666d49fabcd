"""Fault drills forward everything they do not change to the real transport (staging and warm-up included)."""

from __future__ import annotations

import inspect
import threading
import time

import pytest

from hybridkv.transfer import TransferError, TransportError, make_transport
from hybridkv.transfer.ops import Bounds, TransferPlan
from hybridkv.transfer.transport import Completion, Transport, WriteStatus, write_plan
from hybridkv.transfer.transport.base import DONE, BenchGoal
from hybridkv.transfer.transport.drills import Delegating, Throttled
from hybridkv.transfer.transport.mooncake import WARM_WAIT_S
from tests.transfer.test_staging import Recording

COMPOSED = {"create", "check_device", "write", "submit_wait"}  # made of forwarded methods: the drill applies


class Warming(Recording):
    """A recording transport whose every class attribute differs from ``Transport``'s default."""

    max_ops_per_submit = 7
    cross_process = False
    devices = frozenset({"cpu", "meta"})
    shared_arena = True
    bench_goal = BenchGoal("raw writes of a test", 0.5)

    def __init__(self) -> None:
        super().__init__()
        self.warmed: list[str] = []

    def warm(self, session: str) -> None:
        self.warmed.append(session)


def test_a_drill_forwards_every_attribute_and_method_of_the_transport_api() -> None:
    inner = Warming()
    drill = Throttled(inner, 0.0)
    for attr in Transport.__annotations__:
        assert getattr(drill, attr) == getattr(inner, attr), attr
    assert drill.pays_per_op and drill.max_ops_per_submit == 7
    drill.warm("peer:1")
    assert inner.warmed == ["peer:1"]
    api = {name for name, member in vars(Transport).items() if not name.startswith("_") and callable(member)}
    api |= {name for name, member in vars(Transport).items() if isinstance(member, property)}
    missing = {name for name in api - COMPOSED if name not in vars(Delegating)}
    assert not missing, f"Delegating does not forward {sorted(missing)}"
    assert not inspect.isabstract(Delegating)


class _Engine:
    """Stands in for Mooncake's engine during ``warm``: a handshake that raises or never answers."""

    def __init__(self, answer: threading.Event | None) -> None:
        self.answer = answer
        self.calls = 0

    def get_first_buffer_address(self, session: str) -> int:
        self.calls += 1
        if self.answer is None:
            raise ValueError(f"no segment {session}")
        self.answer.wait(30)
        return 0


def test_mooncake_warm_never_raises_and_a_silent_peer_stalls_the_caller_only_briefly() -> None:
    transport = make_transport("mooncake")
    engine = transport._engine  # type: ignore[attr-defined]
    answer = threading.Event()
    try:
        transport._engine = _Engine(None)  # type: ignore[attr-defined]
        transport.warm("127.0.0.1:1")  # not a RuntimeError: still swallowed (and logged)
        silent = transport._engine = _Engine(answer)  # type: ignore[attr-defined]
        start = time.monotonic()
        transport.warm("10.0.0.1:5")
        transport.warm("10.0.0.1:5")  # already in flight: no second handshake, no second wait
        assert time.monotonic() - start < 2 * WARM_WAIT_S + 1.0
        assert silent.calls == 1
    finally:
        answer.set()
        transport._engine = engine  # type: ignore[attr-defined]
        transport.close()


def test_a_drill_applies_to_writes_waited_for_inline() -> None:
    """``submit_wait`` is the base's (the wrapper's ``submit`` and ``wait``): a drill over a
    transport that waits inline still changes every write."""

    class Inline(Recording):
        waits_inline = True

        def submit_wait(self, peer, src, dst, length, bounds=None):  # the real one: bypasses any drill
            raise AssertionError("a drill must not forward submit_wait")

    seen = []

    class Counting(Throttled):
        def submit(self, peer, src, dst, length, bounds=None):
            seen.append(len(dst))
            return super().submit(peer, src, dst, length, bounds)

    drill = Counting(Inline(), 0.0)
    assert drill.waits_inline
    assert drill.submit_wait("peer", [1, 2], [3, 4], [1, 1]).ended
    assert seen == [2] and drill.inner.submits == [2]


def test_write_plan_waits_inline_for_a_one_chunk_plan_and_keeps_its_stop_and_failure_semantics() -> None:
    class Inline(Recording):
        waits_inline = True
        outcome = DONE

        def submit_wait(self, peer, src, dst, length, bounds=None):
            self.submits.append(-len(dst))  # negative: waited for inline
            return self.outcome

    plan = TransferPlan([1, 9], [100, 200], [4, 4], 2, 8, Bounds(1, 13, 100, 204, 4))
    link = Inline()
    assert write_plan(link, "peer", plan, 1 << 20, lambda: "") == 2 and link.submits == [-2]
    asked = iter(["", "aborted"])  # before the chunk, then once it ended: it landed, the write is stopped
    with pytest.raises(TransferError, match="stopped: aborted"):
        write_plan(link, "peer", plan, 1 << 20, lambda: next(asked))
    link.outcome = WriteStatus(Completion.FAILED, "peer gone")
    with pytest.raises(TransportError, match="peer gone"):
        write_plan(link, "peer", plan, 1 << 20, lambda: "")
    link.submits.clear()
    link.outcome = DONE
    assert write_plan(link, "peer", plan, 4, lambda: "") == 2 and link.submits == [1, 1]  # two chunks: polled
