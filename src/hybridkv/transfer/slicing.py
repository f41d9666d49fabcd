"""TP slicing: which prefill TP rank supplies which part of a decode rank's slice.

A sharded entry splits one item dimension (KV heads, a state tensor's ``tp_dim``) over the
TP ranks. With ``total`` elements and ``local`` per rank there are ``total // local``
distinct slices; when TP exceeds that (GQA with fewer KV heads than ranks) each slice is
replicated on ``tp // slices`` consecutive ranks, exactly as ``Parallel.kv_head_range``.

Invariants:
- The pieces returned for one decode rank tile its slice ``[start, start + local)`` without
  gaps or overlap, so every decode byte has exactly one source.
- Among replicas the source is chosen by ``decode_rank % replicas``: deterministic (both
  sides compute the same answer) and spread over the replicas.
- A replicated entry (``total is None``) is one piece from prefill rank
  ``decode_rank % prefill_tp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.transfer.errors import BadLayout


@dataclass(frozen=True)
class Piece:
    src_rank: int  # prefill TP rank that sends this piece
    start: int  # global start along the shard dimension
    end: int  # global end (exclusive)


def replicas(total: int, tp_size: int, local: int, where: str) -> int:
    """How many consecutive ranks hold each slice (1 unless GQA replicates heads)."""
    if local <= 0 or total % local or tp_size % (total // local):
        raise BadLayout(f"{where}: {local} of {total} elements per rank cannot be spread over TP {tp_size}")
    return tp_size // (total // local)


def slice_start(total: int, tp_size: int, local: int, tp_rank: int, where: str) -> int:
    """Global start of the slice that ``tp_rank`` holds."""
    return (tp_rank // replicas(total, tp_size, local, where)) * local


def source_pieces(
    total: int | None,
    src_tp: int,
    src_local: int,
    dst_start: int,
    dst_local: int,
    dst_rank: int,
    where: str,
) -> list[Piece]:
    """Pieces of decode rank ``dst_rank``'s slice, each with the prefill rank that sends it."""
    if total is None:
        return [Piece(dst_rank % src_tp, 0, 1)]
    reps = replicas(total, src_tp, src_local, where)
    end = dst_start + dst_local
    pieces = []
    for k in range(dst_start // src_local, (end - 1) // src_local + 1):
        lo, hi = max(dst_start, k * src_local), min(end, (k + 1) * src_local)
        pieces.append(Piece(k * reps + dst_rank % reps, lo, hi))
    return pieces
