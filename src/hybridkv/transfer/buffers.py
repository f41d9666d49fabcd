"""BufferSet: the memory one (model, PP rank, TP rank) exposes to transfers.

An *entry* is one tensor of one layer over all pages (or state slots) of a pool: item ``i``
(page cell or slot cell ``i``) lies at ``addr + i * stride`` and is ``item_len`` bytes.
Engines with one contiguous buffer per layer have ``stride == item_len``; hybridkv's cell
grid packs every layer of a pool into one cell, so its entries have ``stride ==
cell_bytes``. Both are supported everywhere.

Invariants (checked at construction, also when a BufferSet arrives over the wire):
- ``layer_ids`` is aligned 1:1 with ``entries``: the global layer id of each entry. A
  per-layer id list is expanded by repeating it once per buffer group (MHA: K group then V
  group -> ids twice); an entry count that the id count does not divide is an error.
- Every layer id lies in the rank's PP stage ``[start, end)``.
- ``item_len`` equals the item shape times the dtype size; every entry's span lies inside
  one registered region.
- ``pool`` is the pool id as ``str(PoolId)`` (``"full"``, ``"swa:1024"``, ``"state"``...):
  it reads back with ``PoolId.parse`` (``pool_id``), whose rule gives what a transfer sends.
- Sharded entries say which item dimension TP splits (``shard_dim``: the segment's
  ``tp_dim`` — heads for KV, the state tensor's own split dimension), where this rank's
  slice starts and the unsharded size. Replicated entries (MLA latents, unsplit state)
  have ``shard_dim = None``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

import msgspec

from hybridkv.memory import CellLayout, Segment, UnifiedMemory
from hybridkv.spec import IdSpace, PoolId, PoolIdError, ShardSpec, dtype_name, parse_dtype
from hybridkv.transfer.errors import BadLayout
from hybridkv.transfer.slicing import slice_start


class Role(StrEnum):
    """Which side of a transfer a layout, a cell or an address belongs to."""

    PREFILL = "prefill"
    DECODE = "decode"


class BufferEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One layer's tensor over every item (page or state slot) of one pool."""

    addr: int
    item_len: int
    stride: int
    count: int
    tensor: str  # "k", "v", "latent" or a state tensor name
    pool: str  # str(PoolId): "full", "mla", "swa:<window>", "state"...
    dtype: str
    shape: tuple[int, ...]  # shape of one item
    page_size: int  # tokens per item; 1 for state
    shard_dim: int | None = None
    shard_start: int = 0
    shard_total: int = 0

    def __post_init__(self) -> None:
        where = f"entry {self.tensor!r} of pool {self.pool!r}"
        try:
            self.pool_id  # noqa: B018 (parsing is the check)
        except PoolIdError as exc:
            raise BadLayout(f"{where}: {exc}") from None
        try:
            itemsize = parse_dtype(self.dtype).itemsize
        except ValueError as exc:
            raise BadLayout(f"{where}: {exc}") from None
        if any(d <= 0 for d in self.shape) or self.item_len != math.prod(self.shape) * itemsize:
            raise BadLayout(
                f"{where}: item_len {self.item_len} B does not equal shape {self.shape} x "
                f"{self.dtype} ({math.prod(self.shape) * itemsize} B)"
            )
        if self.addr < 0 or self.count < 1 or self.stride < self.item_len or self.page_size < 1:
            raise BadLayout(
                f"{where}: need addr >= 0, count >= 1, stride >= item_len and page_size >= 1 "
                f"(addr {self.addr}, count {self.count}, stride {self.stride}, item_len "
                f"{self.item_len}, page_size {self.page_size})"
            )
        if self.shard_dim is None:
            if self.shard_start or self.shard_total:
                raise BadLayout(f"{where}: replicated entry with a shard range")
            return
        local = self.shape[self.shard_dim] if 0 <= self.shard_dim < len(self.shape) else 0
        if not local or self.shard_start % local or not 0 <= self.shard_start <= self.shard_total - local:
            raise BadLayout(
                f"{where}: shard dim {self.shard_dim} of shape {self.shape} holds "
                f"[{self.shard_start}, {self.shard_start + local}) of {self.shard_total}, "
                "which is not an aligned slice"
            )

    @property
    def pool_id(self) -> PoolId:
        """The pool this entry lies in; its history rule says which items a request sends."""
        return PoolId.parse(self.pool)

    @property
    def per_slot(self) -> bool:
        """Items are state slots (one per request), not pages."""
        return self.pool_id.id_space is IdSpace.SLOT

    @property
    def length(self) -> int:
        """Bytes spanned from item 0 to the end of the last item."""
        return (self.count - 1) * self.stride + self.item_len

    @property
    def itemsize(self) -> int:
        return parse_dtype(self.dtype).itemsize

    @property
    def shard_len(self) -> int:
        """Elements of the shard dimension this rank holds (1 for replicated entries)."""
        return 1 if self.shard_dim is None else self.shape[self.shard_dim]

    def describe(self, layer_id: int) -> str:
        return (
            f"layer {layer_id} {self.tensor!r} (pool {self.pool!r}, "
            f"{self.dtype} {self.shape}, {self.item_len} B per "
            f"{'slot' if self.per_slot else 'page'})"
        )


class BufferSet(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every entry one rank exposes, the global layer id of each, and its registered regions."""

    model: str
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    layer_range: tuple[int, int]
    entries: tuple[BufferEntry, ...]
    layer_ids: tuple[int, ...]
    regions: tuple[tuple[int, int], ...]  # (addr, length) registered with the transport

    def __post_init__(self) -> None:
        who = self.describe()
        if not (0 <= self.pp_rank < self.pp_size and 0 <= self.tp_rank < self.tp_size):
            raise BadLayout(f"{who}: ranks outside their sizes")
        if len(self.layer_ids) != len(self.entries):
            raise BadLayout(
                f"{who}: {len(self.layer_ids)} layer ids for {len(self.entries)} entries; the "
                "layer-id list must be aligned 1:1 with the entries (use expand_layer_ids)"
            )
        start, end = self.layer_range
        bad = [lid for lid in self.layer_ids if not start <= lid < end]
        if bad:
            raise BadLayout(f"{who}: layer ids {bad[:5]} outside the stage's layers [{start}, {end})")
        for entry, lid in zip(self.entries, self.layer_ids, strict=True):
            if not any(a <= entry.addr and entry.addr + entry.length <= a + n for a, n in self.regions):
                raise BadLayout(
                    f"{who}: {entry.describe(lid)} spans [{entry.addr:#x}, "
                    f"{entry.addr + entry.length:#x}), outside every registered region"
                )

    def describe(self, role: Role | None = None) -> str:
        prefix = f"{role} " if role else ""
        return (
            f"{prefix}{self.model} pp {self.pp_rank}/{self.pp_size} tp "
            f"{self.tp_rank}/{self.tp_size} (layers [{self.layer_range[0]}, {self.layer_range[1]}))"
        )


def expand_layer_ids(layer_ids: Sequence[int], num_entries: int, where: str) -> tuple[int, ...]:
    """Align a layer-id list to ``num_entries`` entries: repeat it once per buffer group.

    One id per entry is returned as is; one id per layer with ``g`` groups of entries (MHA:
    K then V, so ``g = 2``) is repeated ``g`` times. Any other count is an error, never a
    silent positional guess.
    """
    ids = tuple(int(i) for i in layer_ids)
    if not ids:
        if num_entries:
            raise BadLayout(f"{where}: {num_entries} entries but no layer ids")
        return ids
    if num_entries % len(ids):
        raise BadLayout(
            f"{where}: {len(ids)} layer ids cannot describe {num_entries} entries: the entry "
            "count must be a multiple of the id count (one id per layer, repeated per buffer "
            "group)"
        )
    return ids * (num_entries // len(ids))


def buffer_set_from_layouts(
    shard: ShardSpec,
    layouts: Sequence[CellLayout],
    base_addr: int,
    grid_cells: dict[PoolId, int],
    regions: Sequence[tuple[int, int]],
) -> BufferSet:
    """The BufferSet of a hybridkv cell grid starting at ``base_addr``.

    Each pool publishes only its own layers (the segments its layout packs: the full pool its
    full-attention layers, each window pool its SWA layers, the state pool the recurrent
    layers' state tensors). Entries
    come in buffer groups (every layer's ``k``, then every layer's ``v``...), with one id per
    layer expanded per group.
    """
    entries: list[BufferEntry] = []
    ids: list[int] = []
    for layout in layouts:
        names = list(dict.fromkeys(seg.tensor for seg in layout.segments))
        groups = [[seg for seg in layout.segments if seg.tensor == name] for name in names]
        group_ids = [[seg.layer_id for seg in group] for group in groups]
        pool_entries = [
            _entry(shard, layout, seg, base_addr, grid_cells[layout.pool_id]) for group in groups for seg in group
        ]
        if all(g == group_ids[0] for g in group_ids):
            pool_ids = expand_layer_ids(group_ids[0], len(pool_entries), f"pool {str(layout.pool_id)!r}")
        else:  # layers with different state tensors: one id per entry
            pool_ids = tuple(lid for g in group_ids for lid in g)
        entries += pool_entries
        ids += pool_ids
    return BufferSet(
        model=shard.model.name,
        pp_rank=shard.pp_rank,
        pp_size=shard.parallel.pp_size,
        tp_rank=shard.tp_rank,
        tp_size=shard.parallel.tp_size,
        layer_range=shard.bounds,
        entries=tuple(entries),
        layer_ids=tuple(ids),
        regions=tuple((int(a), int(n)) for a, n in regions),
    )


def buffer_set_from_memory(mem: UnifiedMemory, base_addr: int | None = None) -> BufferSet:
    """The BufferSet of a ``UnifiedMemory``: every pool, one registered region (the arena).

    ``base_addr`` defaults to the arena's address; a meta-device memory has none, so layout
    and plan studies pass a made-up base.
    """
    if base_addr is None:
        if not mem.arena.has_data:
            raise BadLayout("a meta-device memory has no addresses: pass base_addr")
        base_addr = mem.arena.buffer.data_ptr()
    return buffer_set_from_layouts(
        mem.shard,
        [pool.layout for pool in mem.pools.values()],
        base_addr,
        {pool_id: pool.grid_cells for pool_id, pool in mem.pools.items()},
        [(base_addr, mem.arena.nbytes)],
    )


def _entry(shard: ShardSpec, layout: CellLayout, seg: Segment, base_addr: int, cells: int) -> BufferEntry:
    shard_dim, start, total = seg.tp_dim, 0, 0
    if shard_dim is not None:
        whole = shard.model.layer(seg.layer_id).kind.cell_tensors(layout.page_size, shard.model.kv_dtype)
        total = next(t.shape[shard_dim] for t in whole if t.name == seg.tensor)
        where = f"{shard.describe()} layer {seg.layer_id} {seg.tensor!r}"
        start = slice_start(total, shard.parallel.tp_size, seg.shape[shard_dim], shard.tp_rank, where)
    return BufferEntry(
        addr=base_addr + seg.offset,
        item_len=seg.nbytes,
        stride=layout.cell_bytes,
        count=cells,
        tensor=seg.tensor,
        pool=str(layout.pool_id),
        dtype=dtype_name(seg.dtype),
        shape=tuple(int(d) for d in seg.shape),
        page_size=layout.page_size,
        shard_dim=shard_dim,
        shard_start=start,
        shard_total=total,
    )
