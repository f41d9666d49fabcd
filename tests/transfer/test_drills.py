"""Fault drills forward everything they do not change to the real transport (staging and warm-up included)."""

from __future__ import annotations

import inspect
import threading
import time

from hybridkv.transfer import make_transport
from hybridkv.transfer.transport import Transport
from hybridkv.transfer.transport.drills import Delegating, Throttled
from hybridkv.transfer.transport.mooncake import WARM_WAIT_S
from tests.transfer.test_staging import Recording

COMPOSED = {"create", "check_device", "write"}  # made of forwarded methods: the wrapper's own changes apply


class Warming(Recording):
    """A recording transport whose every class attribute differs from ``Transport``'s default."""

    max_ops_per_submit = 7
    devices = frozenset({"cpu", "meta"})
    shared_arena = True

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
