"""Where the host-sync tests run: ``HYBRIDKV_TEST_DEVICE`` (``cpu`` by default, or ``cuda``).

The host-sync tests (marked ``host_sync``) build their memory, cache or engine on
``DEVICE`` and run the region they count under ``no_host_sync()``: a ``HostSyncCounter``
everywhere, and on CUDA also ``torch.cuda.set_sync_debug_mode("error")``, so a read the
counter does not know (an implicit device-to-host copy) raises too. ``scripts/gpu_check.sh``
runs them with ``HYBRIDKV_TEST_DEVICE=cuda``. Asking for CUDA where there is none fails the
test (a misconfigured run must not pass by skipping).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from hybridkv.host_sync import HostSyncCounter

DEVICE = os.environ.get("HYBRIDKV_TEST_DEVICE", "cpu")


def device() -> str:
    """The device of this run's host-sync tests (fails the test when it cannot be had)."""
    if DEVICE not in ("cpu", "cuda"):
        pytest.fail(f"HYBRIDKV_TEST_DEVICE must be cpu or cuda, got {DEVICE!r}")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("HYBRIDKV_TEST_DEVICE=cuda but torch sees no CUDA device")
    return DEVICE


@contextmanager
def no_host_sync() -> Iterator[HostSyncCounter]:
    """Count host syncs; on CUDA, also make every synchronizing CUDA call raise."""
    with HostSyncCounter() as counter:
        if device() != "cuda":
            yield counter
            return
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield counter
        finally:
            torch.cuda.set_sync_debug_mode("default")


def sampling_may_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's sampled tokens are its one expected host read: let them synchronize
    under ``no_host_sync`` (the counter still counts them). Patched wherever the engine's
    modules look ``choose_tokens`` up."""
    import hybridkv.engine.engine
    import hybridkv.engine.sched.scheduler

    for module in (hybridkv.engine.engine, hybridkv.engine.sched.scheduler):
        choose = getattr(module, "choose_tokens", None)
        if choose is not None:
            monkeypatch.setattr(module, "choose_tokens", _with_sync(choose))


def _with_sync(choose: Callable[..., list[int]]) -> Callable[..., list[int]]:
    def choose_with_sync(*args: object, **kwargs: object) -> list[int]:
        with syncs_allowed():
            return choose(*args, **kwargs)

    return choose_with_sync


@contextmanager
def syncs_allowed() -> Iterator[None]:
    """Inside ``no_host_sync``: a read the test expects (the sampled tokens) may synchronize."""
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if mode:
        torch.cuda.set_sync_debug_mode("default")
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)
