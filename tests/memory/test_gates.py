"""Move gates: a gate is PINNING until it is RELEASED, by hand or when its event completes."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.memory import GateStatus, PinnedError, UnifiedMemory
from hybridkv.spec import ShardSpec, get_preset


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_gate_pins_until_released_and_its_two_statuses_differ():
    mem = UnifiedMemory.create(ShardSpec.whole(get_preset("tiny-gdn")), 300_000, page_size=4, max_context=32)
    pages, slots = mem.alloc_pages(2), mem.alloc_state(1)
    event = FakeEvent()
    gate = mem.pin(pages=pages, slots=slots, event=event)
    assert gate.status is GateStatus.PINNING and GateStatus.PINNING is not GateStatus.RELEASED
    assert mem.gates.pinning_gates == 1 and (mem.gates.page_pins[pages] == 1).all()
    with pytest.raises(PinnedError):
        mem.free_pages(pages)
    assert mem.gates.sweep() == 0 and gate.status is GateStatus.PINNING  # event not done: still pinning
    event.done = True
    assert mem.gates.sweep() == 1 and gate.status is GateStatus.RELEASED
    assert mem.gates.pinning_gates == 0 and not mem.gates.page_pins.any() and not mem.gates.slot_pins.any()
    gate.release()  # idempotent
    assert gate.status is GateStatus.RELEASED
    mem.free_pages(pages)
    mem.free_state(slots)
    mem.verify()

    with mem.pin(pages=mem.alloc_pages(1)) as held:
        assert held.status is GateStatus.PINNING
    assert held.status is GateStatus.RELEASED and mem.gates.pinning_gates == 0
    assert np.count_nonzero(mem.gates.page_pins) == 0
