"""The scheduler's three roles over a stub KV façade: the statuses it gives requests and the verbs it calls.

``StubKV`` implements the verbs ``Scheduler`` calls on ``RequestKV`` over a page counter (no model, no memory):
each call is logged, and the stub checks what the real façade would refuse (an allocation for a request never
admitted, a free of memory freed already), so these tests fail when the scheduler calls in the wrong order.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import pytest

from hybridkv.engine.sched.agreement import ALONE, Agreement
from hybridkv.engine.sched.kv import Admission, Budget, StepRows
from hybridkv.engine.sched.request import HELD, FinishReason, Request, RequestStatus, SamplingParams
from hybridkv.engine.sched.sampling import NON_FINITE
from hybridkv.engine.sched.scheduler import Role, Scheduler
from hybridkv.memory import OutOfMemory

PAGE = 4


@dataclass
class _Match:
    length: int = 0


@dataclass
class StubHandle:
    """What the scheduler reads of a ``KVHandle``: its length and its admission's match."""

    seq_len: int = 0
    pages: int = 0
    match: _Match = field(default_factory=_Match)


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


class StubKV:
    """The façade's verbs over ``capacity`` pages; ``log`` holds ``(verb, rid)`` for every call."""

    page_size = PAGE
    prefix_cache = False
    model_has_state = False
    has_state = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.log: list[tuple[str, Hashable]] = []

    def calls(self, rid: Hashable) -> list[str]:
        return [verb for verb, r in self.log if r == rid]

    def _grow(self, req: Request, tokens: int) -> int:
        assert req.kv is not None
        return max(0, _pages(tokens) - req.kv.pages)  # type: ignore[attr-defined]

    def plan(self, req: Request) -> None:
        self.log.append(("plan", req.rid))

    def admit(self, req: Request, budget: Budget, agree: Agreement = ALONE) -> Admission:
        self.log.append(("admit", req.rid))
        assert req.kv is None, "admitted twice without a free"
        if req.status is RequestStatus.RECEIVING:
            need = _pages(len(req.prompt))
            if self.used + need > self.capacity:
                return Admission.REFUSED
            req.kv = StubHandle(len(req.prompt), need)  # type: ignore[assignment]
            self.used += need
            return Admission.ADMITTED
        if self.capacity < 1:
            return Admission.TOO_BIG
        need = _pages(min(budget.tokens, len(req.tokens))) + budget.pages
        if self.used + need > self.capacity and not budget.alone:
            return Admission.REFUSED
        if need > self.capacity:
            return Admission.TOO_BIG
        req.kv = StubHandle()  # type: ignore[assignment]
        return Admission.ADMITTED

    def pages_needed(self, reqs: list[Request], ends: list[int]) -> int:
        return sum(self._grow(r, n) for r, n in zip(reqs, ends, strict=True))

    def allocate(self, reqs: list[Request], spans: list[int], agree: Agreement = ALONE) -> StepRows:
        for req in reqs:
            self.log.append(("allocate", req.rid))
            assert req.kv is not None and req.status is RequestStatus.RUNNING, "allocate before admit"
        ends = [r.computed + s for r, s in zip(reqs, spans, strict=True)]
        need = self.pages_needed(reqs, ends)
        if self.used + need > self.capacity:
            raise OutOfMemory(f"{need} pages wanted, {self.capacity - self.used} free")
        for req, end in zip(reqs, ends, strict=True):
            h: StubHandle = req.kv  # type: ignore[assignment]
            self.used += self._grow(req, end)
            h.pages, h.seq_len = max(h.pages, _pages(end)), max(h.seq_len, end)
        return StepRows([np.arange(1, 1 + r.kv.pages) for r in reqs], None, None, None)  # type: ignore[union-attr]

    def computed(self, reqs: list[Request], release_windows: bool = True) -> None:
        for req in reqs:
            self.log.append(("computed", req.rid))
            assert req.kv is not None, "computed without memory"

    def free(self, *reqs: Request, cache: bool) -> None:
        for req in reqs:
            self.log.append(("free" if cache else "free-retract", req.rid))
            if cache:
                assert req.kv is not None, "cached a request that holds nothing"
            if req.kv is not None:
                self.used -= req.kv.pages  # type: ignore[attr-defined]
                req.kv = None


def _req(rid: int, prompt_len: int = 6, new: int = 3) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_new_tokens=new, ignore_eos=True))


def _run(sched: Scheduler, kv: StubKV, token: int = 7, limit: int = 100) -> None:
    """Step until no work is left, choosing ``token`` for every row whose span ends its known tokens."""
    for _ in range(limit):
        if not sched.has_work():
            return
        step = sched.next_step()
        if step is not None:  # None: what waited failed at admission
            sched.complete(step, [token if i in step.ending else None for i in range(len(step.reqs))])
    raise AssertionError("the scheduler never finished")


def test_a_whole_engine_admits_before_it_allocates_and_frees_each_request_once_cached() -> None:
    kv = StubKV(capacity=64)
    sched = Scheduler(kv, chunk_size=4, max_running=4, max_step_tokens=16)  # type: ignore[arg-type]
    reqs = [_req(0), _req(1, prompt_len=9)]
    for req in reqs:
        sched.add(req)
    assert [r.status for r in reqs] == [RequestStatus.WAITING] * 2 and set(sched.requests) == {0, 1}
    step = sched.next_step()
    assert step is not None and [r.status for r in reqs] == [RequestStatus.RUNNING] * 2
    sched.complete(step, [None] * len(step.reqs))
    _run(sched, kv)
    for req in reqs:
        calls = kv.calls(req.rid)
        assert calls[:3] == ["plan", "admit", "allocate"]
        assert calls[-1] == "free" and calls.count("free") == 1 and "free-retract" not in calls
        assert calls.count("allocate") == calls.count("computed")  # one forward for each allocation
        assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.LENGTH
        assert req.output == [7, 7, 7] and req.computed == len(req.tokens) - 1
    assert sched.take_finished() == reqs and not sched.requests and kv.used == 0


def test_decodes_ride_on_top_of_the_step_budget() -> None:
    """The step budget bounds the prompt tokens: with two requests decoding, a step still takes a whole budget of
    prompt chunks (18 tokens, not 16)."""
    kv = StubKV(capacity=64)
    sched = Scheduler(kv, chunk_size=4, max_running=8, max_step_tokens=16)  # type: ignore[arg-type]
    decoding = [_req(0, prompt_len=4, new=5), _req(1, prompt_len=4, new=5)]
    for req in decoding:
        sched.add(req)
    step = sched.next_step()
    assert step is not None and step.spans == [4, 4]
    sched.complete(step, [7, 7])
    for rid in range(2, 6):
        sched.add(_req(rid, prompt_len=8))
    step = sched.next_step()
    assert step is not None and step.spans == [1, 1, 4, 4, 4, 4]  # the decodes, then 16 prompt tokens
    sched.complete(step, [7, 7, None, None, None, None])
    sched.add(_req(6, prompt_len=13))
    step = sched.next_step()  # each prompt's second chunk takes the budget: the new prompt waits
    assert step is not None and step.spans == [1, 1, 4, 4, 4, 4] and sched.waiting[0].rid == 6
    _run(sched, kv)
    assert kv.used == 0


def test_memory_pressure_retracts_the_newest_frees_it_and_queues_it_first() -> None:
    kv = StubKV(capacity=5)  # two prompts of 2 pages each fit; their decodes do not both grow
    sched = Scheduler(kv, chunk_size=8, max_running=4, max_step_tokens=32)  # type: ignore[arg-type]
    first, second, third = _req(0, prompt_len=8, new=6), _req(1, prompt_len=8, new=6), _req(2, prompt_len=4)
    for req in (first, second, third):
        sched.add(req)
    _run(sched, kv)
    assert not sched.has_work()
    assert second.retractions >= 1 and first.retractions == 0  # the newest goes, never the oldest
    assert sched.retractions == second.retractions + third.retractions
    calls = kv.calls(1)
    assert calls.count("free-retract") == second.retractions and calls.count("free") == 1
    assert calls[-1] == "free"
    for i, verb in enumerate(calls):  # every retraction is followed by a new admission before any allocation
        if verb == "free-retract" and i + 1 < len(calls):
            assert calls[i + 1] == "admit"
    assert all(r.status is RequestStatus.FINISHED and r.output == [7] * len(r.output) for r in (first, second, third))
    assert kv.used == 0 and not sched.requests


def test_a_retracted_request_goes_back_to_the_front_of_the_queue() -> None:
    kv = StubKV(capacity=4)
    sched = Scheduler(kv, chunk_size=8, max_running=4, max_step_tokens=32)  # type: ignore[arg-type]
    a, b, c = _req(0, prompt_len=8, new=4), _req(1, prompt_len=8, new=4), _req(2, prompt_len=20)
    for req in (a, b, c):
        sched.add(req)
    step = sched.next_step()  # a and b admitted (2 pages each); c waits
    assert step is not None and step.reqs == [a, b] and list(sched.waiting) == [c]
    sched.complete(step, [7, 7])  # both need a third page to decode: 6 of 4
    step = sched.next_step()
    assert step is not None and step.reqs == [a]
    assert b.status is RequestStatus.WAITING and list(sched.waiting) == [b, c] and b.kv is None
    assert kv.calls(1)[-1] == "free-retract" and b.retractions == 1 and b.computed == 0


@pytest.mark.parametrize("prompt_len", [20, 8])
def test_a_request_too_big_even_alone_fails_and_is_freed_once(prompt_len: int) -> None:
    """20 tokens: its first chunk does not fit (refused at admission); 8: it is admitted and prefilled, and its
    first decode does not fit (retracted while alone)."""
    kv = StubKV(capacity=2)
    sched = Scheduler(kv, chunk_size=4, max_running=4, max_step_tokens=16)  # type: ignore[arg-type]
    big = _req(0, prompt_len=prompt_len)
    sched.add(big)
    _run(sched, kv)
    assert big.status is RequestStatus.FINISHED and big.finish_reason is FinishReason.ERROR
    assert "does not fit the memory budget even alone" in (big.error or "")
    assert kv.calls(0).count("free-retract") == 1 and "free" not in kv.calls(0)
    assert ("allocate" in kv.calls(0)) is (prompt_len == 8) and big.retractions == 0
    assert sched.take_finished() == [big] and kv.used == 0 and not sched.requests


def test_abort_frees_a_waiting_or_running_request_once_and_ends_it() -> None:
    kv = StubKV(capacity=64)
    sched = Scheduler(kv, chunk_size=4, max_running=1, max_step_tokens=16)  # type: ignore[arg-type]
    running, waiting = _req(0), _req(1)
    sched.add(running)
    sched.add(waiting)
    step = sched.next_step()
    assert step is not None and step.reqs == [running] and waiting.status is RequestStatus.WAITING
    sched.complete(step, [None])
    assert sched.abort(1) is waiting and sched.abort(0) is running
    assert sched.abort(0) is None and sched.abort(99) is None  # ended, unknown
    for req in (running, waiting):
        assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.ABORT
        assert kv.calls(req.rid)[-1] == "free-retract" and kv.calls(req.rid).count("free-retract") == 1
    assert not sched.has_work() and not sched.requests and kv.used == 0


def test_broken_logits_end_a_request_as_an_error_and_free_it() -> None:
    kv = StubKV(capacity=64)
    sched = Scheduler(kv, chunk_size=8, max_running=4, max_step_tokens=16)  # type: ignore[arg-type]
    req = _req(0)
    sched.add(req)
    _run(sched, kv, token=NON_FINITE)
    assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.ERROR
    assert kv.calls(0)[-1] == "free-retract" and "free" not in kv.calls(0) and kv.used == 0


def test_a_prefill_engine_hands_off_a_computed_prompt_and_frees_it_once_sent() -> None:
    kv = StubKV(capacity=64)
    sched = Scheduler(kv, chunk_size=4, max_running=4, max_step_tokens=16, role=Role.PREFILL)  # type: ignore[arg-type]
    req = _req(0, prompt_len=6)
    sched.add(req)
    step = sched.next_step()
    assert step is not None and sched.computed(step) == [] and req.status is RequestStatus.RUNNING
    sched.chosen(step, [None])
    step = sched.next_step()
    assert step is not None and step.ending == [0]
    assert sched.computed(step) == [req] and req.status is RequestStatus.HANDED_OFF
    sched.chosen(step, [7])
    assert req.output == [7] and not sched.running and not sched.has_work()
    assert sched.holds(0) and sched.held() == [req] and req.status in HELD
    assert sched.next_step() is None and "free" not in kv.calls(0)  # its KV stays while it is sent
    assert sched.release_sent(0) is req
    assert req.status is RequestStatus.FINISHED and kv.calls(0)[-1] == "free" and kv.calls(0).count("free") == 1
    assert not sched.holds(0) and not sched.requests and sched.take_finished() == [] and kv.used == 0


def test_a_decode_engine_reserves_receives_and_decodes_or_drops() -> None:
    kv = StubKV(capacity=4)
    sched = Scheduler(kv, chunk_size=4, max_running=4, max_step_tokens=16, role=Role.DECODE)  # type: ignore[arg-type]
    ok, lost, too_many = _req(0, prompt_len=6, new=3), _req(1, prompt_len=6), _req(2, prompt_len=6)
    assert sched.alone_in_memory
    assert sched.reserve(ok) and sched.reserve(lost)
    assert ok.status is lost.status is RequestStatus.RECEIVING and sched.held() == [ok, lost]
    assert not sched.reserve(too_many)  # 2 + 2 pages held of 4
    assert too_many.status is RequestStatus.WAITING and too_many.kv is None and not sched.alone_in_memory
    assert not sched.has_work() and sched.next_step() is None
    sched.abandon(1)
    assert lost.status is RequestStatus.ABANDONED and sched.holds(1)
    assert sched.drop(1) is lost
    assert lost.status is RequestStatus.FINISHED and kv.calls(1) == ["admit", "free-retract"]
    assert sched.take_finished() == []  # dropped silently: whoever gave it up reported why
    assert sched.received(0, 7) is ok
    assert kv.calls(0)[:2] == ["admit", "computed"] and ok.status is RequestStatus.RUNNING
    assert ok.computed == 6 and ok.output == [7] and sched.running == [ok]
    _run(sched, kv)
    assert ok.status is RequestStatus.FINISHED and ok.output == [7, 7, 7] and ok.finish_reason is FinishReason.LENGTH
    assert kv.calls(0).count("free") == 1 and kv.calls(0)[-1] == "free"
    assert sched.alone_in_memory and sched.reserve(too_many)


@pytest.mark.parametrize("first", [3, 7])
def test_a_received_request_whose_first_token_ends_it_is_freed_at_once(first: int) -> None:
    kv = StubKV(capacity=8)
    sched = Scheduler(kv, chunk_size=4, max_running=4, max_step_tokens=16, role=Role.DECODE)  # type: ignore[arg-type]
    req = Request(0, [5, 6, 7], SamplingParams(max_new_tokens=1 if first == 7 else 4), stops=frozenset({3}))
    assert sched.reserve(req)
    sched.received(0, first)
    assert req.status is RequestStatus.FINISHED and kv.calls(0) == ["admit", "computed", "free"]
    assert req.finish_reason is (FinishReason.EOS if first == 3 else FinishReason.LENGTH)
    assert sched.take_finished() == [req] and not sched.running and kv.used == 0
