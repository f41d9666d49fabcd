"""Fault drills are registered types: a drill is a frozen ``Drill`` with the hooks it acts in plus one ``FAULTS``
line, and ``FaultPlan``, the prefill worker's hooks and ``check_faults`` ask it (none of them names a kind)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from hybridkv.engine.disagg import PDConfig
from hybridkv.engine.disagg.config import check_faults
from hybridkv.engine.disagg.faults import (
    FAULTS,
    Drill,
    Fault,
    FaultPlan,
    HandOff,
    Target,
    on_compute,
    on_hand_off,
    slows_writes,
)


class Nudged(Exception):
    pass


@dataclass(frozen=True)
class NudgeDecode(Drill):
    """A drill of this test only: targets a decode rank, acts only while a prefill worker computes."""

    target: ClassVar[Target] = Target.DECODE_RANK

    def on_compute(self, fault: Fault, prefill_tp: int, rank: int, tid: str) -> None:
        raise Nudged(f"{fault.kind} {tid} on prefill rank {rank}")


FAULTS.add("test-nudge-decode", NudgeDecode())


def test_a_new_drill_is_one_frozen_type_and_one_registry_line() -> None:
    fault = Fault("test-nudge-decode", 3, rank=1)
    check_faults(PDConfig("/m", prefill_pp=1, decode_tp=2, faults=(fault,)))  # rank 1 of decode_tp 2 exists
    with pytest.raises(ValueError, match=r"rank 1 does not exist with decode_tp 1; use a rank in 0\.\.0 or raise"):
        check_faults(PDConfig("/m", prefill_pp=2, decode_tp=1, faults=(fault,)))
    plan = FaultPlan([fault], prefill_tp=1)
    assert plan.on_dispatch(3, 1) == fault and plan.on_dispatch(3, 2) is None  # the default: first attempt only
    assert plan.on_first(3, 1) is None and not plan.on_sending(3, 1, 0) and not slows_writes([fault])
    assert on_hand_off(fault, 1, 0) == HandOff()
    with pytest.raises(Nudged, match="test-nudge-decode r-3 on prefill rank 0"):
        on_compute(fault, 1, 0, "r-3")


def test_each_product_drill_acts_in_its_own_hooks() -> None:
    kill_p, kill_d = Fault("kill-prefill", 0, rank=1, delay_s=5.0), Fault("kill-decode", 1, rank=1)
    stall, crash = Fault("stall-transfer", 2, rank=7, delay_s=3.0), Fault("crash-prefill", 3, rank=1)
    plan = FaultPlan([kill_p, kill_d, stall, crash], prefill_tp=2)
    assert [plan.on_dispatch(i, 1) for i in range(4)] == [kill_p, None, stall, crash]
    assert [plan.on_dispatch(i, 2) for i in range(4)] == [None, None, None, crash]  # a poison request: every attempt
    assert [plan.on_first(i, 1) for i in range(4)] == [None, 1, None, None] and plan.on_first(1, 2) is None
    assert [r for r in range(4) if plan.on_sending(0, 1, r)] == [2] and not plan.on_sending(0, 2, 2)  # stage 1, TP 0
    assert slows_writes([kill_p]) and not slows_writes([kill_d, stall, crash])
    assert [on_hand_off(kill_p, 2, r) for r in (2, 0)] == [HandOff(write_delay_s=5.0), HandOff(write_delay_s=0.0)]
    assert on_hand_off(stall, 2, 0) == HandOff(hold_s=3.0) and on_hand_off(crash, 2, 2) == on_hand_off(None, 2, 2)
    on_compute(crash, 2, 0, "r-3")  # another stage's rank computes it unharmed
    with pytest.raises(RuntimeError, match="deliberate fault crash-prefill: prefill stage 1 computes r-3"):
        on_compute(crash, 2, 2, "r-3")
    assert [Fault(k, 0).target for k in FAULTS if not k.startswith("test-")] == [
        Target.PREFILL_STAGE,
        Target.DECODE_RANK,
        Target.NONE,
        Target.PREFILL_STAGE,
    ]
    check_faults(PDConfig("/m", prefill_pp=1, decode_tp=1, faults=(stall,)))  # stall-transfer's rank names nothing
