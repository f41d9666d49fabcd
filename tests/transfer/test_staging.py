"""SourceStaging: strided source pieces gathered so a chunk goes out as one Mooncake op per destination run."""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.transfer import make_transport
from hybridkv.transfer.ops import Bounds, Ops, TransferPlan
from hybridkv.transfer.transport.base import DONE, Transport, TransportName, WriteHandle
from hybridkv.transfer.transport.staging import STAGE_BYTES, STAGE_OP_BYTES, SourceStaging
from hybridkv.transfer.transport.writer import write_plan

HEAD, HEADS, TOKENS = 64, 2, 48  # a TP-sliced page row: one head of each token, the decode side holds only it


def test_staged_ops_land_the_same_bytes_at_the_same_places_with_one_op_per_destination_run() -> None:
    receiver, writer = make_transport("mooncake"), make_transport("mooncake")
    gen = torch.Generator().manual_seed(0)
    src_buf = torch.randint(0, 256, (TOKENS * HEADS * HEAD,), dtype=torch.uint8, generator=gen)
    dst_buf = torch.zeros(2 * TOKENS * HEAD, dtype=torch.uint8)
    try:
        receiver.register(dst_buf.data_ptr(), dst_buf.numel())
        writer.register(src_buf.data_ptr(), src_buf.numel())
        stage = SourceStaging(writer, src_buf, nbytes=TOKENS * HEAD)
        tok = np.arange(TOKENS, dtype=np.int64)
        # head 1 of every token into two destination runs (a gap after token 23), sorted by destination
        src = src_buf.data_ptr() + tok * HEADS * HEAD + HEAD
        dst = dst_buf.data_ptr() + tok * HEAD + np.where(tok >= 24, HEAD, 0)
        length = np.full(TOKENS, HEAD, dtype=np.int64)
        bounds = Bounds(int(src.min()), int(src.max()) + HEAD, int(dst.min()), int(dst.max()) + HEAD, HEAD)
        s, d, n, b = stage.gather(src, dst, length, bounds)
        assert len(d) == 2 and list(n) == [24 * HEAD, 24 * HEAD] and stage.staged_chunks == 1
        assert b.src_lo == stage.addr and b.src_hi == stage.addr + TOKENS * HEAD and b[2:] == bounds[2:]
        writer.write(receiver.session, s, d, n, b)
        want = torch.zeros_like(dst_buf)
        rows = src_buf.view(TOKENS, HEADS, HEAD)[:, 1].reshape(-1)
        want[: 24 * HEAD] = rows[: 24 * HEAD]
        want[25 * HEAD : 49 * HEAD] = rows[24 * HEAD :]
        assert torch.equal(dst_buf, want)

        # nothing to gain (every op a run of its own) or more bytes than the buffer: the ops go out as given
        half = slice(0, TOKENS // 2)
        spread = dst_buf.data_ptr() + tok[half] * 2 * HEAD
        assert stage.gather(src[half], spread, length[half], bounds)[1] is spread
        small = SourceStaging(writer, src_buf, nbytes=HEAD)
        assert small.gather(src, dst, length, bounds)[1] is dst and small.staged_chunks == 0
    finally:
        writer.close()
        receiver.close()


class Recording(Transport):
    """A transport that pays per op and only records what it is asked (ops per submit, warm-ups)."""

    name = TransportName.MOONCAKE
    max_ops_per_submit = 1024
    cross_process = True
    pays_per_op = True

    def __init__(self) -> None:
        self.submits: list[int] = []

    @property
    def session(self) -> str:
        return "recording"

    def check_session(self, session: str) -> None:
        pass

    def register(self, addr: int, length: int) -> None:
        pass

    def submit(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> WriteHandle:
        self.submits.append(len(dst))
        return WriteHandle(peer, len(dst), DONE)

    def close(self) -> None:
        pass


def _plan(source: torch.Tensor, ops: int, op_bytes: int) -> TransferPlan:
    """``ops`` strided source pieces of ``op_bytes`` (every other piece of ``source``) into one contiguous run."""
    i = np.arange(ops, dtype=np.int64)
    src = source.data_ptr() + 2 * op_bytes * i
    dst = (1 << 40) + op_bytes * i
    length = np.full(ops, op_bytes, dtype=np.int64)
    bounds = Bounds(int(src[0]), int(src[-1]) + op_bytes, int(dst[0]), int(dst[-1]) + op_bytes, op_bytes)
    return TransferPlan(src, dst, length, ops, ops * op_bytes, bounds)


def test_large_ops_keep_the_chunk_size_and_small_ops_are_chunked_to_the_staging_buffer() -> None:
    source = torch.zeros(8 << 20, dtype=torch.uint8)
    transport = Recording()
    stage = SourceStaging(transport, source)  # STAGE_BYTES
    # 16 ops of 256 KiB (4 MiB): not worth staging, so one submit of 64 MiB chunks, not four of the buffer's size
    big = _plan(source, 16, 256 << 10)
    assert write_plan(transport, "peer", big, 64 << 20, lambda: "", stage) == 16
    assert transport.submits == [16] and stage.staged_chunks == 0
    # 1024 ops of 2 KiB (2 MiB): chunked to the 1 MiB buffer, each chunk staged into one op
    transport.submits.clear()
    small = _plan(source, 1024, 2 << 10)
    assert small.nbytes < STAGE_OP_BYTES * small.num_ops
    assert write_plan(transport, "peer", small, 64 << 20, lambda: "", stage) == 2
    assert transport.submits == [1, 1] and stage.staged_chunks == 2
    assert stage.limit(big, 64 << 20) == 64 << 20 and stage.limit(small, 64 << 20) == STAGE_BYTES
