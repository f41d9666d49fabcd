"""Cell layouts: how one sub-pool packs its layers' bytes into one grid cell.

A *cell* is the unit a sub-pool allocates: for a token pool, one page (``page_size`` tokens)
of every layer of that pool on this shard; for a slot pool (recurrent state), one request's
state of every recurrent layer. Which pool a layer joins and what it packs are its kind's
answers (``LayerKind.pool_id`` / ``cell_tensors``); nothing here branches on the kind.
A sub-pool's cells sit on a uniform grid over the whole arena (cell ``c`` occupies bytes
``[c * cell_bytes, (c + 1) * cell_bytes)``), so each segment of a cell (the K page of
layer 7, the conv state of layer 12...) is a plain strided tensor view of the arena.

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

from hybridkv.spec import CellTensor, IdSpace, PoolId, ShardSpec, dtype_name


@dataclass(frozen=True)
class Segment:
    """One tensor of one layer inside a cell."""

    layer_id: int
    tensor: str  # "k", "v", "latent", or a state tensor's name
    dtype: torch.dtype
    shape: tuple[int, ...]  # shape of this tensor inside one cell
    offset: int  # bytes from the cell start
    tp_dim: int | None  # dimension of ``shape`` split across TP ranks (None: replicated)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class CellLayout:
    """The geometry of one sub-pool: which layers, how many tokens a cell, its segments."""

    pool_id: PoolId
    page_size: int  # tokens per cell; 1 for a slot pool (one slot = one request)
    segments: tuple[Segment, ...]
    cell_bytes: int

    @property
    def id_space(self) -> IdSpace:
        return self.pool_id.id_space

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

    def cells_per_request(self, context: int, in_flight: int = 0) -> int:
        """Cells one request of ``context`` tokens holds here, from the pool's history rule:
        every page for a full-history pool; the pages its longest span (plus ``in_flight``
        tokens computed before the span moves on, e.g. a prefill chunk) can straddle for a
        bounded pool; one for a slot pool."""
        pool = self.pool_id
        if pool.id_space is IdSpace.SLOT:
            return 1
        pages = -(-context // self.page_size)
        if pool.max_span is None:
            return pages
        span = min(context, pool.max_span + in_flight)
        return min(pages, -(-span // self.page_size) + 1)

    def segment(self, layer_id: int, tensor: str) -> Segment:
        for seg in self.segments:
            if seg.layer_id == layer_id and seg.tensor == tensor:
                return seg
        names = sorted({s.tensor for s in self.segments if s.layer_id == layer_id})
        raise KeyError(
            f"pool {self.pool_id}: layer {layer_id} has no tensor {tensor!r}"
            + (f" (it has {names})" if names else f" (layers here: {self.layer_ids})")
        )

    def describe(self) -> str:
        unit = "slot" if self.id_space is IdSpace.SLOT else f"page of {self.page_size} tokens"
        return (
            f"{self.pool_id}: {len(self.layer_ids)} layers, {self.cell_bytes} B per {unit}, "
            f"dtypes {sorted({dtype_name(s.dtype) for s in self.segments})}"
        )


class _Packer:
    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.offset = 0
        self.align = 1

    def add(self, layer_id: int, tensor: CellTensor) -> None:
        size = tensor.dtype.itemsize
        self.offset = -(-self.offset // size) * size
        self.align = max(self.align, size)
        seg = Segment(layer_id, tensor.name, tensor.dtype, tensor.shape, self.offset, tensor.tp_dim)
        self.segments.append(seg)
        self.offset += seg.nbytes

    def cell_bytes(self) -> int:
        return -(-self.offset // self.align) * self.align


def cell_tokens(pool_id: PoolId, page_size: int) -> int:
    """Tokens one cell of the pool holds: a page, or 1 for a slot pool."""
    return page_size if pool_id.id_space is IdSpace.PAGE else 1


def build_layouts(shard: ShardSpec, page_size: int) -> list[CellLayout]:
    """One layout per pool id this shard's layers need, in pool order (``PoolId.sort_key``):
    full, mla, windows ascending, state; each layer's tensors as its kind packs them."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    packers: dict[PoolId, _Packer] = {}
    for layer in shard.layers:
        kind = shard.local_kind(layer.layer_id)
        pool_id = kind.pool_id
        if pool_id is None:
            continue
        packer = packers.setdefault(pool_id, _Packer())
        for tensor in kind.cell_tensors(cell_tokens(pool_id, page_size), shard.model.kv_dtype):
            packer.add(layer.layer_id, tensor)
    return [
        CellLayout(pool_id, cell_tokens(pool_id, page_size), tuple(p.segments), p.cell_bytes())
        for pool_id, p in sorted(packers.items(), key=lambda item: item[0].sort_key())
    ]
