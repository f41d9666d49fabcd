"""Cell layouts: how one sub-pool packs its layers' bytes into one grid cell.

A *cell* is the unit a sub-pool allocates: for a KV pool, one page (``page_size`` tokens)
of every layer of that kind on this shard; for the state pool, one request's state of
every recurrent layer. A sub-pool's cells sit on a uniform grid over the whole arena (cell
``c`` occupies bytes ``[c * cell_bytes, (c + 1) * cell_bytes)``), so each segment of a cell
(the K page of layer 7, the conv state of layer 12...) is a plain strided tensor view of
the arena.

Invariants:
- Segments are laid out in layer order, never overlap, and each starts at a multiple of
  its dtype's item size; ``cell_bytes`` is a multiple of every segment's item size, so
  every view is aligned.
- Only this shard's layers appear, with this TP rank's head / state dimensions.
- ``padding_bytes`` is the only slack inside a cell (alignment); page sizes are never padded
  to match another pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridkv.spec import (
    MLA,
    FullAttention,
    KindTag,
    Linear,
    ShardSpec,
    SlidingWindow,
    dtype_name,
)

FULL_POOL = "full"
MLA_POOL = "mla"
STATE_POOL = "state"


def swa_pool_name(window: int) -> str:
    return f"swa:{window}"


@dataclass(frozen=True)
class Segment:
    """One tensor of one layer inside a cell."""

    layer_id: int
    tensor: str  # "k", "v", "latent", or a state tensor's name
    dtype: torch.dtype
    shape: tuple[int, ...]  # shape of this tensor inside one cell
    offset: int  # bytes from the cell start

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class CellLayout:
    """The geometry of one sub-pool: which layers, how many tokens a cell, its segments."""

    name: str
    tag: KindTag
    page_size: int  # tokens per cell; 1 for the state pool (one slot = one request)
    window: int | None
    segments: tuple[Segment, ...]
    cell_bytes: int

    @property
    def is_state(self) -> bool:
        return self.tag is KindTag.LINEAR

    @property
    def is_window(self) -> bool:
        return self.tag is KindTag.SWA

    @property
    def layer_ids(self) -> list[int]:
        return sorted({s.layer_id for s in self.segments})

    @property
    def data_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def padding_bytes(self) -> int:
        return self.cell_bytes - self.data_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.cell_bytes / self.page_size

    def segment(self, layer_id: int, tensor: str) -> Segment:
        for seg in self.segments:
            if seg.layer_id == layer_id and seg.tensor == tensor:
                return seg
        names = sorted({s.tensor for s in self.segments if s.layer_id == layer_id})
        raise KeyError(
            f"pool {self.name!r}: layer {layer_id} has no tensor {tensor!r}"
            + (f" (it has {names})" if names else f" (layers here: {self.layer_ids})")
        )

    def describe(self) -> str:
        unit = "slot" if self.is_state else f"page of {self.page_size} tokens"
        return (
            f"{self.name}: {len(self.layer_ids)} layers, {self.cell_bytes} B per {unit}, "
            f"dtypes {sorted({dtype_name(s.dtype) for s in self.segments})}"
        )


class _Packer:
    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.offset = 0
        self.align = 1

    def add(self, layer_id: int, tensor: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        size = dtype.itemsize
        self.offset = -(-self.offset // size) * size
        self.align = max(self.align, size)
        seg = Segment(layer_id, tensor, dtype, shape, self.offset)
        self.segments.append(seg)
        self.offset += seg.nbytes

    def cell_bytes(self) -> int:
        return -(-self.offset // self.align) * self.align


def build_layouts(shard: ShardSpec, page_size: int) -> list[CellLayout]:
    """One layout per sub-pool this shard needs, in a fixed order: full, mla, swa..., state."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    dtype = shard.model.kv_dtype
    packers: dict[str, tuple[KindTag, int | None, _Packer]] = {}

    def packer(name: str, tag: KindTag, window: int | None = None) -> _Packer:
        if name not in packers:
            packers[name] = (tag, window, _Packer())
        return packers[name][2]

    for layer in shard.layers:
        kind = shard.local_kind(layer.layer_id)
        lid = layer.layer_id
        if isinstance(kind, FullAttention | SlidingWindow):
            if isinstance(kind, SlidingWindow):
                p = packer(swa_pool_name(kind.window), KindTag.SWA, kind.window)
            else:
                p = packer(FULL_POOL, KindTag.FULL)
            p.add(lid, "k", dtype, (page_size, kind.num_kv_heads, kind.head_dim))
            p.add(lid, "v", dtype, (page_size, kind.num_kv_heads, kind.v_head_dim))
        elif isinstance(kind, MLA):
            p = packer(MLA_POOL, KindTag.MLA)
            p.add(lid, "latent", dtype, (page_size, 1, kind.elems_per_token()))
        elif isinstance(kind, Linear):
            p = packer(STATE_POOL, KindTag.LINEAR)
            for state in kind.states:
                p.add(lid, state.name, state.dtype, state.shape)

    order = {KindTag.FULL: 0, KindTag.MLA: 1, KindTag.SWA: 2, KindTag.LINEAR: 3}
    layouts = [
        CellLayout(
            name=name,
            tag=tag,
            page_size=1 if tag is KindTag.LINEAR else page_size,
            window=window,
            segments=tuple(p.segments),
            cell_bytes=p.cell_bytes(),
        )
        for name, (tag, window, p) in packers.items()
    ]
    return sorted(layouts, key=lambda lay: (order[lay.tag], lay.window or 0))
