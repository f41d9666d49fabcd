"""SourceStaging: strided source pieces gathered so a chunk goes out as one Mooncake op per destination run."""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.transfer import make_transport
from hybridkv.transfer.plan import Bounds
from hybridkv.transfer.transport.staging import SourceStaging

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
