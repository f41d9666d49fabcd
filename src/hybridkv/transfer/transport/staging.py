"""SourceStaging: gather a chunk's strided source pieces so it goes out as one op per destination run.

Why: a transport that pays per op (Mooncake over TCP moves every op as its own transfer, about
35 us each on an idle host, far more on a loaded one) suffers when a plan's ops are small. That
happens whenever the decode TP size exceeds the prefill one: every token of a source page holds
all of a layer's heads, the decode page only this rank's, so the source pieces are strided (one
op per token and head) while the destination is contiguous per page. Gathering the source
pieces, in op order, into one registered buffer makes each destination run a single op.

Invariants:
- The staged ops write exactly the bytes the given ops would, to exactly the same destination
  addresses (the ops are sorted by destination and disjoint, as every plan's are); the checksum
  of a leg is unaffected (it reads the stream in destination order either way).
- Only plans of small ops are chunked to the buffer's size (``limit``: mean op bytes under
  ``STAGE_OP_BYTES``); other plans keep the caller's chunk size, so their chunks go out unstaged
  with no more submits than without staging.
- A chunk is staged only when it fits the buffer and at least halves the op count; otherwise its
  ops are returned unchanged (large pieces gain nothing from an extra copy).
- The buffer is reused by the next ``gather``: the caller must not gather again while a submit of
  the previous staged ops may still read it (``write_plan`` has one chunk in flight at a time).
- Only the owner of the buffer (one thread) calls ``gather``; source and staging are host memory.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.transfer.ops import Bounds, Ops, TransferPlan
from hybridkv.transfer.transport.base import Transport

STAGE_BYTES = 1 << 20
"""Bytes of one sender's staging buffer: chunks above it go out unstaged."""
STAGE_OP_BYTES = STAGE_BYTES >> 6
"""Plans whose mean op is below this many bytes are chunked to the staging buffer (a staged
chunk then replaces about 64 ops or more by one per destination run); larger ops keep the
caller's chunk size: staging could save only a few per-op costs, while capping their chunks
at the buffer's size would multiply the submit round trips (up to 64x for 64 MiB chunks)."""


class SourceStaging:
    def __init__(self, transport: Transport, source: torch.Tensor, nbytes: int = STAGE_BYTES) -> None:
        """``source``: the registered uint8 host tensor every source address lies in (the arena)."""
        if source.dtype != torch.uint8 or source.device.type != "cpu":
            raise ValueError(f"staging gathers from a uint8 host tensor, got {source.dtype} on {source.device}")
        self.nbytes = nbytes
        self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        self._stage = self._buffer.numpy()
        self._source = source.numpy()
        self._source_addr = source.data_ptr()
        self.addr = self._buffer.data_ptr()
        transport.register(self.addr, nbytes)
        self.staged_chunks = 0  # chunks that went out staged (for tests and reports)

    def limit(self, plan: TransferPlan, chunk_bytes: int) -> int:
        """Bytes per chunk for ``plan``: the buffer's size when its ops are small enough to be
        worth staging (mean under ``STAGE_OP_BYTES``), else ``chunk_bytes`` (sent unstaged)."""
        if plan.nbytes < STAGE_OP_BYTES * plan.num_ops:
            return min(chunk_bytes, self.nbytes)
        return chunk_bytes

    def gather(self, src: Ops, dst: Ops, length: Ops, bounds: Bounds) -> tuple[Ops, Ops, Ops, Bounds]:
        """The ops to submit instead of ``(src, dst, length)`` (sorted by destination), and their bounds."""
        d = np.asarray(dst, dtype=np.int64)
        n = np.asarray(length, dtype=np.int64)
        if d.size < 2:
            return src, dst, length, bounds
        total = int(n.sum())
        joined = d[1:] == d[:-1] + n[:-1]
        runs = d.size - int(np.count_nonzero(joined))
        if total > self.nbytes or 2 * runs > d.size:
            return src, dst, length, bounds
        s = np.asarray(src, dtype=np.int64) - self._source_addr
        at = np.cumsum(n) - n  # where each op's bytes start in the staging buffer
        self._stage[:total] = self._source[np.repeat(s - at, n) + np.arange(total, dtype=np.int64)]
        starts = np.flatnonzero(np.concatenate(([True], ~joined)))
        self.staged_chunks += 1
        staged = Bounds(self.addr, self.addr + total, bounds.dst_lo, bounds.dst_hi, bounds.min_len)
        return self.addr + at[starts], d[starts], np.add.reduceat(n, starts), staged
