"""``bench engine``'s transformers side: the phase clock splits a pass's CPU and positions by the forwards' shape, and
the engine's computed tokens are priced at a padded pass's cost per phase."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest
import torch

from hybridkv.bench.hf_baselines import DECODE, PREFILL, PhaseClock, padded, same_mix_cpu_s
from hybridkv.engine.random_models import build_random


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


class _Forward(torch.nn.Module):
    """A module whose forward only looks at its ids' shape (the clock reads nothing else)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids


@pytest.fixture
def no_collection() -> Iterator[None]:
    """The garbage collector off: a full collection in a worker holding many objects takes tens of milliseconds of
    CPU, and one falling between the test's clock reads and the block's would count outside the block."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_the_clock_splits_cpu_and_positions_at_each_change_of_phase(no_collection: None) -> None:
    model, clock = _Forward(), PhaseClock()
    start = time.process_time()
    with clock.counting(model):
        _spin(0.02)  # before the first forward: the prefill's (building its inputs)
        model(input_ids=torch.zeros(2, 5))
        _spin(0.03)
        for _ in range(2):  # decodes, and generate's work between them
            model(input_ids=torch.zeros(2, 1))
            _spin(0.05)
        model(torch.zeros(3, 4))  # the next batch's prefill, the ids given by position
        _spin(0.02)
        model(input_ids=torch.zeros(3, 1))
        _spin(0.04)
    total = time.process_time() - start
    assert clock.positions == {PREFILL: 10 + 12, DECODE: 2 + 2 + 3} and clock.computed == 29
    assert clock.cpu_s[PREFILL] >= 0.07 and clock.cpu_s[DECODE] >= 0.14
    assert clock.cpu_s[PREFILL] < 0.07 + 0.02 and clock.cpu_s[DECODE] < 0.14 + 0.02
    assert sum(clock.cpu_s.values()) == pytest.approx(total, abs=0.005)
    report = clock.report()
    assert report["phase_positions"] == clock.positions
    assert report["cpu_us_per_phase_position"][DECODE] == pytest.approx(1e6 * clock.cpu_s[DECODE] / 7, rel=0.01)
    model(input_ids=torch.zeros(1, 9))  # the hook is gone after the block
    assert clock.computed == 29


def test_a_phase_that_never_ran_has_no_price() -> None:
    model = _Forward()
    with PhaseClock().counting(model) as clock:
        model(input_ids=torch.zeros(1, 3))
    prices = clock.report()["cpu_us_per_phase_position"]
    assert prices[DECODE] is None and prices[PREFILL] is not None and prices[PREFILL] >= 0


def test_a_padded_pass_reports_its_phases_and_prices_the_engine_mix() -> None:
    model, _ = build_random("tiny-gemma3")
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    outs, computed, extra = padded(model, prompts, 4, 2, 0)  # batches of 2 and 1, 4 new tokens each
    assert [len(o) for o in outs] == [4, 4, 4]
    # prefill: every padded position (2 x 5, 1 x 3); decode: one position per row for each new token but the first
    assert extra["phase_positions"] == {PREFILL: 2 * 5 + 1 * 3, DECODE: 3 * 3} and computed == 13 + 9
    assert extra["phase_cpu_s"][PREFILL] > 0 and extra["phase_cpu_s"][DECODE] > 0
    prefill_us, decode_us = (extra["cpu_us_per_phase_position"][k] for k in (PREFILL, DECODE))
    priced = same_mix_cpu_s(100, 10, extra)
    assert priced == pytest.approx(1e-6 * (100 * prefill_us + 10 * decode_us), rel=0.01)
    assert same_mix_cpu_s(0, 0, extra) == 0


def test_pricing_tokens_of_a_phase_the_padded_pass_never_ran_is_refused() -> None:
    extra = {"phase_cpu_s": {PREFILL: 1.0, DECODE: 0.0}, "phase_positions": {PREFILL: 100, DECODE: 0}}
    assert same_mix_cpu_s(50, 0, extra) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no decode forward: it cannot price 3 decode tokens"):
        same_mix_cpu_s(50, 3, extra)
