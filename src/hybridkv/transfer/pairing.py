"""Pairing: which prefill entry feeds which decode entry, by global layer id.

Invariants:
- Entries pair by (global layer id, occurrence of that id): the k-th prefill entry of
  layer 7 feeds the k-th decode entry of layer 7, whatever their positions. Positions are
  used only on request (``positional=True``) and only when prefill has one PP stage, and
  even then the ids must agree.
- Only the layers both ranks hold are paired: prefill entries outside the decode rank's
  stage belong to another decode stage. Within the overlap, a layer present on one side
  and missing on the other is an error.
- Every pair is checked before any byte moves: pool family and tensor, dtype, page size,
  pool id (the history rule, e.g. the window), item shape (equal except along the
  TP-sharded dimension, whose unsharded size must agree) and each side's TP slice.
  Every error names both ranks and what to change.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.transfer.buffers import BufferEntry, BufferSet, Role
from hybridkv.transfer.errors import BadLayout, LayoutMismatch
from hybridkv.transfer.slicing import slice_start


@dataclass(frozen=True)
class EntryPair:
    layer_id: int
    src: int  # index into the prefill entries
    dst: int  # index into the decode entries


def pair_entries(prefill: BufferSet, decode: BufferSet, *, positional: bool = False) -> tuple[EntryPair, ...]:
    """Pair every entry of the layers both ranks hold; raise ``LayoutMismatch`` on any doubt."""
    sides = f"{prefill.describe(Role.PREFILL)} -> {decode.describe(Role.DECODE)}"
    if prefill.model != decode.model:
        raise LayoutMismatch(
            f"{sides}: prefill serves model {prefill.model!r}, decode {decode.model!r}; "
            "connect engines of the same model"
        )
    pairs = _pair_positional(prefill, decode) if positional else _pair_by_id(prefill, decode)
    for pair in pairs:
        check_pair(prefill, decode, pair)
    return pairs


def _pair_positional(prefill: BufferSet, decode: BufferSet) -> tuple[EntryPair, ...]:
    sides = f"{prefill.describe(Role.PREFILL)} -> {decode.describe(Role.DECODE)}"
    if prefill.pp_size != 1:
        raise LayoutMismatch(
            f"{sides}: positional pairing is only safe when prefill has one PP stage, prefill "
            f"has {prefill.pp_size}; pair by layer id instead"
        )
    if len(prefill.entries) != len(decode.entries):
        raise LayoutMismatch(
            f"{sides}: positional pairing needs equal entry counts, prefill has "
            f"{len(prefill.entries)} and decode {len(decode.entries)}; pair by layer id instead"
        )
    for i, (a, b) in enumerate(zip(prefill.layer_ids, decode.layer_ids, strict=True)):
        if a != b:
            raise LayoutMismatch(
                f"{sides}: entry {i} is layer {a} on prefill but layer {b} on decode; "
                "positional pairing would send the wrong layer, pair by layer id instead"
            )
    return tuple(EntryPair(lid, i, i) for i, lid in enumerate(prefill.layer_ids))


def _occurrences(bufs: BufferSet, lo: int, hi: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for index, lid in enumerate(bufs.layer_ids):
        if lo <= lid < hi:
            out.setdefault(lid, []).append(index)
    return out


def _pair_by_id(prefill: BufferSet, decode: BufferSet) -> tuple[EntryPair, ...]:
    sides = f"{prefill.describe(Role.PREFILL)} -> {decode.describe(Role.DECODE)}"
    lo = max(prefill.layer_range[0], decode.layer_range[0])
    hi = min(prefill.layer_range[1], decode.layer_range[1])
    src = _occurrences(prefill, lo, hi)
    dst = _occurrences(decode, lo, hi)
    pairs = []
    for lid in sorted(src.keys() | dst.keys()):
        s, d = src.get(lid, []), dst.get(lid, [])
        s_names = [prefill.entries[i].tensor for i in s]
        d_names = [decode.entries[i].tensor for i in d]
        if not d:
            raise LayoutMismatch(
                f"{sides}: layer {lid} ({', '.join(s_names)}) is missing on decode; both "
                "engines must keep the same layers in memory (same model and kinds)"
            )
        if not s:
            raise LayoutMismatch(
                f"{sides}: decode expects layer {lid} ({', '.join(d_names)}) but the prefill "
                "stage that holds it publishes no entry for it"
            )
        if len(s) != len(d):
            raise LayoutMismatch(
                f"{sides}: layer {lid} has {len(s)} entries on prefill {s_names} but {len(d)} "
                f"on decode {d_names}; publish the same buffer groups on both sides"
            )
        pairs += [EntryPair(lid, i, j) for i, j in zip(s, d, strict=True)]
    return tuple(pairs)


def check_pair(prefill: BufferSet, decode: BufferSet, pair: EntryPair) -> None:
    """Raise ``LayoutMismatch`` unless the two entries can feed each other."""
    a, b = prefill.entries[pair.src], decode.entries[pair.dst]
    lid = pair.layer_id

    def fail(what: str, hint: str) -> LayoutMismatch:
        return LayoutMismatch(
            f"{what} mismatch: {prefill.describe(Role.PREFILL)} has {a.describe(lid)}, "
            f"{decode.describe(Role.DECODE)} has {b.describe(lid)}; {hint}"
        )

    if a.pool_id.family != b.pool_id.family or a.tensor != b.tensor:
        raise fail("tensor", "both sides must publish the same tensors per layer, in order")
    if a.dtype != b.dtype:
        raise fail("dtype", "run both engines with the same KV and state dtypes")
    if a.page_size != b.page_size:
        raise fail("page size", "start both engines with the same page_size")
    if a.pool_id != b.pool_id:
        raise fail("pool", "both engines must use the model's history rules (e.g. its sliding windows)")
    size = "state slot size" if a.per_slot else "item length"
    if a.shard_dim != b.shard_dim or a.shard_total != b.shard_total or len(a.shape) != len(b.shape):
        raise fail(size, "both engines must shard this tensor along the same dimension")
    same = [i for i in range(len(a.shape)) if i != a.shard_dim]
    if [a.shape[i] for i in same] != [b.shape[i] for i in same]:
        raise fail(size, "the tensors differ outside their TP dimension (different model config)")
    for bufs, entry, role in ((prefill, a, Role.PREFILL), (decode, b, Role.DECODE)):
        _check_slice(bufs, entry, lid, role)


def _check_slice(bufs: BufferSet, entry: BufferEntry, lid: int, role: Role) -> None:
    if entry.shard_dim is None:
        return
    where = f"{bufs.describe(role)} {entry.describe(lid)}"
    want = slice_start(entry.shard_total, bufs.tp_size, entry.shard_len, bufs.tp_rank, where)
    if entry.shard_start != want:
        raise BadLayout(
            f"{where}: TP rank {bufs.tp_rank} of {bufs.tp_size} must hold the slice from "
            f"{want}, the entry says {entry.shard_start}"
        )


def check_prefill_group(prefills: Sequence[BufferSet]) -> None:
    """The prefill ranks of one engine: one model, every (pp, tp) once, stages tile the layers."""
    if not prefills:
        raise LayoutMismatch("no prefill ranks registered")
    first = prefills[0]
    ranks = {(b.pp_rank, b.tp_rank) for b in prefills}
    want = {(p, t) for p in range(first.pp_size) for t in range(first.tp_size)}
    odd = [
        b.describe(Role.PREFILL)
        for b in prefills
        if (b.model, b.pp_size, b.tp_size) != (first.model, first.pp_size, first.tp_size)
    ]
    if odd or ranks != want or len(prefills) != len(want):
        raise LayoutMismatch(
            f"prefill engine of {first.model!r} pp {first.pp_size} tp {first.tp_size} is "
            f"inconsistent: ranks {sorted(ranks)} (need {sorted(want)})"
            + (f", disagreeing ranks: {odd}" if odd else "")
        )
    stages = sorted({(b.pp_rank, b.layer_range) for b in prefills})
    ranges = [r for _, r in stages]
    if len(stages) != first.pp_size or ranges[0][0] != 0 or any(a[1] != b[0] for a, b in itertools.pairwise(ranges)):
        raise LayoutMismatch(f"prefill stages (pp rank, layers) {stages} do not tile the layers")


def check_coverage(decode: BufferSet, prefills: Sequence[BufferSet]) -> None:
    """Every layer the decode rank holds lies in exactly one prefill stage."""
    stages = {(b.pp_rank, b.layer_range) for b in prefills}
    for lid in sorted(set(decode.layer_ids)):
        holders = [pp for pp, (s, e) in stages if s <= lid < e]
        if len(holders) != 1:
            raise LayoutMismatch(
                f"{decode.describe(Role.DECODE)}: layer {lid} lies in {len(holders)} prefill "
                f"stages (stages: {sorted(stages)}); prefill must cover every layer once"
            )
