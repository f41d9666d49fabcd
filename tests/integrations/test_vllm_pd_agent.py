"""PD mode's byte half (``integrations/vllm/pd_agent.py``) without vLLM: a sender and receivers in this
process over hybridkv's Mooncake transport (TCP), on caches shaped as vLLM's CPU caches
``(2, blocks, heads, block size, head size)``: blocks land where the receiver said, from the blocks
the sender held; a mismatched layout, a position not held, a request sent twice, one whose hold expired
and a foreign cluster key are refused and reported failed, with nothing written; a taken port is named."""

from __future__ import annotations

import importlib.util
import socket
import time
from collections.abc import Iterator

import pytest
import torch

from hybridkv.integrations.vllm.pd_agent import NULL, CacheLayer, Load, PDReceiver, PDSender, build_layout, layer_id
from hybridkv.transfer.auth import ClusterKey
from hybridkv.transfer.errors import TransferError
from hybridkv.transfer.transport import make_transport

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="no mooncake package (pip install hybridkv[mooncake])"
)
BLOCKS = 8


def caches(block: int = 4, fill: bool = True) -> list[CacheLayer]:
    torch.manual_seed(0)
    out = []
    for i, pool in enumerate(("swa:8", "full")):
        t = torch.randn(2, BLOCKS, 1, block, 8) if fill else torch.zeros(2, BLOCKS, 1, block, 8)
        out.append(CacheLayer(f"model.layers.{i}.self_attn.attn", i, t, 1, pool, block))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def receiver(layers: list[CacheLayer], key: ClusterKey, name: str = "D") -> PDReceiver:
    bufs, groups = build_layout("m", layers)
    return PDReceiver(name, bufs, groups, make_transport("mooncake", protocol="tcp"), key, wait_s=3.0)


def outcome(r: PDReceiver, request: str, timeout_s: float = 10.0) -> bool:
    """True: loaded, False: failed."""
    deadline = time.monotonic() + timeout_s
    done: set[str] = set()
    failed: set[str] = set()
    while time.monotonic() < deadline:
        d, f = r.results()
        done |= d
        failed |= f
        if request in done | failed:
            return request in done
        time.sleep(0.02)
    raise AssertionError(f"no outcome for {request}")


@pytest.fixture
def sender() -> Iterator[tuple[PDSender, list[CacheLayer], ClusterKey]]:
    key = ClusterKey.generate()
    layers = caches()
    bufs, groups = build_layout("m", layers)
    s = PDSender("P", bufs, groups, make_transport("mooncake", protocol="tcp"), f"tcp://127.0.0.1:{free_port()}", key)
    yield s, layers, key
    s.close()


def test_blocks_land_where_the_receiver_said(sender: tuple[PDSender, list[CacheLayer], ClusterKey]) -> None:
    s, src, key = sender
    dst = caches(fill=False)
    r = receiver(dst, key)
    try:
        s.hold("p1", [[NULL, 2, 5], [3, 4, 7]])  # group 0 (window) no longer holds position 0
        r.submit(Load("d1", "p1", "P", s.endpoint, {0: [NULL, 6, 1], 1: [0, 1, 2]}))
        assert outcome(r, "d1")
        assert s.finished() == {"p1"}
        for kv in range(2):
            assert torch.equal(dst[0].tensor[kv, 6], src[0].tensor[kv, 2])
            assert torch.equal(dst[0].tensor[kv, 1], src[0].tensor[kv, 5])
            for pos, (a, b) in enumerate(((3, 0), (4, 1), (7, 2))):
                assert torch.equal(dst[1].tensor[kv, b], src[1].tensor[kv, a]), pos
        untouched = [b for b in range(BLOCKS) if b not in (6, 1)]
        assert not dst[0].tensor[:, untouched].any()
        assert not dst[1].tensor[:, 3:].any()
        assert r.stats.loaded == 1 and r.stats.ops == 2 * 2 + 2 * 3
        # the same request again: already sent, refused
        r.submit(Load("d2", "p1", "P", s.endpoint, {0: [NULL, 6, 1], 1: [0, 1, 2]}))
        assert not outcome(r, "d2")
        assert "no longer held" in r.stats.errors[-1] and "it was sent" in r.stats.errors[-1]
        # a position the sender does not hold: refused whole, nothing written, its blocks released
        dst[1].tensor.zero_()
        s.hold("p2", [[NULL, 2, 5], [3, 4, 7]])
        r.submit(Load("d3", "p2", "P", s.endpoint, {0: [0, 6, 1], 1: [0, 1, 2]}))
        assert not outcome(r, "d3")
        assert "position 0 of group 0" in r.stats.errors[-1] and not dst[1].tensor.any()
        assert s.finished() == {"p2"}
    finally:
        r.close()


def test_a_mismatched_layout_is_refused_naming_both_sides(
    sender: tuple[PDSender, list[CacheLayer], ClusterKey],
) -> None:
    s, _, key = sender
    dst = caches(block=8, fill=False)  # another block size
    r = receiver(dst, key)
    try:
        s.hold("p1", [[1], [2]])
        r.submit(Load("d1", "p1", "P", s.endpoint, {0: [3], 1: [4]}))
        assert not outcome(r, "d1")
        err = r.stats.errors[-1]
        assert "page size mismatch" in err and "prefill" in err and "decode" in err and "page_size" in err
        assert not dst[0].tensor.any() and not dst[1].tensor.any()
        assert s.finished() == {"p1"}  # refused: the prefill side frees the blocks at once
    finally:
        r.close()


def test_a_foreign_key_moves_nothing(sender: tuple[PDSender, list[CacheLayer], ClusterKey]) -> None:
    s, _, _ = sender
    dst = caches(fill=False)
    r = receiver(dst, ClusterKey.generate())  # another cluster
    try:
        s.hold("p1", [[1], [2]])
        r.submit(Load("d1", "p1", "P", s.endpoint, {0: [3], 1: [4]}))
        assert not outcome(r, "d1")
        assert "no answer" in r.stats.errors[-1]
        assert s.stats.refused_frames >= 2 and s.stats.sent == 0  # its Hello and its request
        assert not dst[0].tensor.any() and s.finished() == set()  # still held for the real decode
    finally:
        r.close()


def test_blocks_no_decode_asked_for_are_freed_after_their_hold(
    sender: tuple[PDSender, list[CacheLayer], ClusterKey],
) -> None:
    s, _, key = sender
    s.hold_s = 0.2
    s.hold("p1", [[1], [2]])
    assert s.finished() == set()
    time.sleep(0.3)
    assert s.finished() == {"p1"} and s.stats.expired == 1
    dst = caches(fill=False)
    r = receiver(dst, key)
    try:  # a decode side asking later is refused, nothing written
        r.submit(Load("d1", "p1", "P", s.endpoint, {0: [3], 1: [4]}))
        assert not outcome(r, "d1")
        assert "its hold of 0.2 s expired" in r.stats.errors[-1] and not dst[1].tensor.any()
        assert s.finished() == set()  # freed once only
    finally:
        r.close()


def test_a_taken_port_is_named(sender: tuple[PDSender, list[CacheLayer], ClusterKey]) -> None:
    s, _, key = sender
    bufs, groups = build_layout("m", caches())
    with pytest.raises(TransferError, match=f"cannot listen on {s.endpoint} .*pick a free pd_port"):
        PDSender("P2", bufs, groups, make_transport("mooncake", protocol="tcp"), s.endpoint, key)


def test_layer_ids_come_from_layer_names() -> None:
    assert layer_id("model.layers.17.self_attn.attn") == 17
    assert layer_id("language_model.model.layers.3.mixer") == 3
    with pytest.raises(TransferError, match="no layer index"):
        layer_id("lm_head")
