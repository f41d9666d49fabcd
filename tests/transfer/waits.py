"""Bounded waits the transfer tests share: poll an observable condition, never sleep a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable

from hybridkv.transfer import Phase


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def wait_phase(dec, rid: str, phase: Phase, timeout_s: float = 20.0):
    """Poll the decode receiver until ``rid`` reaches ``phase`` (or later); its report."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        dec.poll()
        report = dec.status(rid)
        if report is not None and report.phase >= phase:
            return report
        time.sleep(0.01)
    raise AssertionError(f"{rid} never reached {phase.label}: {dec.status(rid)}")


def wait_released(res, timeout_s: float) -> None:
    """Poll the decode receiver of ``res`` (``Reservations``) until it holds no request's pages;
    the reservations it hands back are freed."""
    assert res.settle(timeout_s) == 0
