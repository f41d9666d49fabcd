"""A disaggregated server runs each rank in a process of its own: ``PDConfig`` accepts only a transport whose
class says it carries KV between processes (``Transport.cross_process``), before any model is read."""

from __future__ import annotations

import pytest

from hybridkv.engine.disagg import PDConfig
from hybridkv.engine.disagg.config import check_layout
from hybridkv.transfer.transport import TRANSPORTS, ShmTransport


def test_every_transport_states_whether_it_crosses_processes() -> None:
    assert {name: kind.cross_process for name, kind in TRANSPORTS.items()} == {"shm": True, "mooncake": True}


def test_an_in_process_transport_is_refused_before_any_model_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ShmTransport, "cross_process", False)  # as an in-process rig's transport says
    with pytest.raises(ValueError, match=r"transport .shm. moves KV only inside one process, .*use one of mooncake$"):
        check_layout(PDConfig("/nonexistent-model-dir", transport="shm"))
    with pytest.raises(ValueError, match="unknown transport 'nixl'; known: shm, mooncake"):
        check_layout(PDConfig("/nonexistent-model-dir", transport="nixl"))
