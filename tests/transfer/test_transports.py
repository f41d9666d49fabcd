"""Transports copy exactly the ops given and refuse ranges or memory they must not touch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import ShardSpec, get_preset
from hybridkv.transfer import (
    DecodeReceiver,
    PrefillSender,
    SharedBuffer,
    TransferError,
    TransportError,
    make_transport,
)
from hybridkv.transfer.plan import Bounds


def test_shm_copies_big_and_small_ops_and_refuses_foreign_ranges():
    peer = SharedBuffer(1 << 16)
    receiver = make_transport("shm", peer)
    writer = make_transport("shm")
    src = torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8)
    base = src.data_ptr()
    writer.register(base, src.numel())
    src_off = np.array([0, 5000, 100, 7], dtype=np.int64)
    dst_off = np.array([8192, 0, 40000, 60000], dtype=np.int64)
    length = np.array([4096, 3000, 37, 1], dtype=np.int64)  # two memmoves, two vectorized
    writer.write(receiver.session, base + src_off, peer.addr + dst_off, length)
    got, want = peer.tensor.numpy(), src.numpy()
    for s, d, n in zip(src_off, dst_off, length, strict=True):
        assert np.array_equal(got[d : d + n], want[s : s + n])
    untouched = np.ones(got.size, dtype=bool)
    for d, n in zip(dst_off, length, strict=True):
        untouched[d : d + n] = False
    assert not got[untouched].any()
    before = got.copy()
    with pytest.raises(TransportError, match="outside the peer's buffer"):
        writer.write(receiver.session, base + src_off, peer.addr + dst_off + (1 << 16) - 4096, length)
    with pytest.raises(TransportError, match="outside every registered local region"):
        writer.write(receiver.session, base + src_off + (1 << 16), peer.addr + dst_off, length)
    honest = Bounds(base, base + (1 << 16), peer.addr, peer.addr + (1 << 16), 1)
    with pytest.raises(TransportError, match="outside the peer's buffer"):  # the caller's bounds are checked too
        writer.write(
            receiver.session, base + src_off, peer.addr + dst_off, length, honest._replace(dst_hi=peer.addr + (1 << 17))
        )
    loose = honest._replace(src_lo=base - 1, src_hi=base + (1 << 20))  # not in one region: each op is checked
    with pytest.raises(TransportError, match="outside every registered local region"):
        writer.write(receiver.session, base + src_off + (1 << 16), peer.addr + dst_off, length, loose)
    with pytest.raises(TransportError, match="not a shm session"):
        writer.write("tcp://nope", base + src_off, peer.addr + dst_off, length)
    assert np.array_equal(got, before)  # refused writes copy nothing
    writer.close()
    receiver.close()
    peer.close()


def test_agents_refuse_memory_their_transport_cannot_touch():
    meta = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-dense")), "1MiB", device="meta", page_size=4, max_context=64
    )
    link = make_transport("shm")
    for agent in (PrefillSender, DecodeReceiver):
        with pytest.raises(TransferError, match="moves \\['cpu'\\] memory, this memory is on 'meta'"):
            agent(meta, "e", "tcp://127.0.0.1:9", link)
