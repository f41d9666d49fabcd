"""Parallel layout: pipeline stages over layers, tensor-parallel ranks over heads.

Invariants:
- A PP stage is ``[start, end)`` over global layer ids, end exclusive, always; stages tile
  ``0 .. num_layers`` without gaps or overlap; custom boundaries are allowed.
- A TP rank holds the KV heads ``[head_start, head_end)`` of every attention layer. When a
  layer has fewer KV heads than TP ranks (GQA), each head is replicated on
  ``tp_size // num_kv_heads`` consecutive ranks. MLA latents are replicated on all ranks;
  recurrent state tensors are split along their own ``tp_dim``. Each kind shards itself
  (``LayerKind.shard``); this module only knows the head arithmetic.
- ``ShardSpec`` is the one object every pool, geometry query and transfer layout is built
  from: (model, layout, pp_rank, tp_rank). It never assumes a stage starts at layer 0 or
  that its first layer is full attention.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hybridkv.spec.layers import KVHeads, LayerKind
from hybridkv.spec.model import Layer, ModelSpec


@dataclass(frozen=True)
class Parallel:
    tp_size: int = 1
    pp_size: int = 1
    pp_starts: tuple[int, ...] | None = None
    """Optional first layer of each stage (``pp_starts[0] == 0``); default splits evenly."""

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"TP and PP sizes must be >= 1, got tp={self.tp_size} pp={self.pp_size}")
        if self.pp_starts is not None:
            starts = list(self.pp_starts)
            if len(starts) != self.pp_size:
                raise ValueError(
                    f"pp_starts has {len(starts)} entries but pp_size is {self.pp_size}; "
                    "give one first-layer id per stage"
                )
            if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
                raise ValueError(
                    f"pp_starts {starts} must start at 0 and increase strictly (every stage needs at least one layer)"
                )

    def stage_bounds(self, num_layers: int) -> list[tuple[int, int]]:
        """``[start, end)`` of every stage. Even split gives the first stages the remainder."""
        if self.pp_size > num_layers:
            raise ValueError(
                f"PP size {self.pp_size} exceeds the model's {num_layers} layers; every stage needs at least one layer"
            )
        if self.pp_starts is not None:
            if self.pp_starts[-1] >= num_layers:
                raise ValueError(
                    f"pp_starts {list(self.pp_starts)} leaves the last stage empty: the model "
                    f"has layers 0..{num_layers - 1}"
                )
            starts = list(self.pp_starts)
        else:
            base, extra = divmod(num_layers, self.pp_size)
            starts, at = [], 0
            for rank in range(self.pp_size):
                starts.append(at)
                at += base + (1 if rank < extra else 0)
        ends = [*starts[1:], num_layers]
        return list(zip(starts, ends, strict=True))

    def kv_head_range(self, num_kv_heads: int, tp_rank: int) -> tuple[int, int]:
        """KV heads ``[start, end)`` that ``tp_rank`` holds (GQA replication when heads < TP)."""
        self._check_tp_rank(tp_rank)
        tp = self.tp_size
        if num_kv_heads >= tp:
            if num_kv_heads % tp:
                raise ValueError(
                    f"{num_kv_heads} KV heads cannot be split evenly over TP {tp}; use a TP "
                    f"size that divides {num_kv_heads}"
                )
            per = num_kv_heads // tp
            return tp_rank * per, (tp_rank + 1) * per
        if tp % num_kv_heads:
            raise ValueError(
                f"TP {tp} is not a multiple of {num_kv_heads} KV heads, so heads cannot be "
                "replicated evenly; use a TP size that is a multiple of the KV head count"
            )
        head = tp_rank // (tp // num_kv_heads)
        return head, head + 1

    def _check_tp_rank(self, tp_rank: int) -> None:
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"TP rank {tp_rank} outside 0..{self.tp_size - 1}")


@dataclass(frozen=True)
class ShardSpec:
    """The part of a model one device holds: one PP stage, one TP rank."""

    model: ModelSpec
    parallel: Parallel
    pp_rank: int = 0
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.pp_rank < self.parallel.pp_size:
            raise ValueError(f"PP rank {self.pp_rank} outside 0..{self.parallel.pp_size - 1}")
        self.parallel._check_tp_rank(self.tp_rank)
        for layer in self.layers:  # fail at construction if any layer cannot be sharded
            self.local_kind(layer.layer_id)

    @classmethod
    def whole(cls, model: ModelSpec) -> ShardSpec:
        return cls(model, Parallel())

    @property
    def bounds(self) -> tuple[int, int]:
        return self.parallel.stage_bounds(self.model.num_layers)[self.pp_rank]

    @property
    def layers(self) -> tuple[Layer, ...]:
        start, end = self.bounds
        return self.model.layers[start:end]

    def has_layer(self, layer_id: int) -> bool:
        start, end = self.bounds
        return start <= layer_id < end

    def layer_ids(self, tag: str) -> list[int]:
        return [layer.layer_id for layer in self.layers if layer.tag == tag]

    def kv_head_range(self, layer_id: int) -> tuple[int, int]:
        kind = self._stage_layer(layer_id).kind
        if not isinstance(kind, KVHeads):
            raise ValueError(f"layer {layer_id} is {kind.tag}, which has no KV heads")
        return self.parallel.kv_head_range(kind.num_kv_heads, self.tp_rank)

    def local_kind(self, layer_id: int) -> LayerKind:
        """The layer's kind as this rank holds it (heads / state dims divided by TP)."""
        return self._stage_layer(layer_id).kind.shard(self.parallel, self.tp_rank)

    def _stage_layer(self, layer_id: int) -> Layer:
        if not self.has_layer(layer_id):
            start, end = self.bounds
            raise KeyError(f"layer {layer_id} is not on PP stage {self.pp_rank} (layers [{start}, {end}))")
        return self.model.layers[layer_id]

    def describe(self) -> str:
        start, end = self.bounds
        return (
            f"{self.model.name} pp {self.pp_rank}/{self.parallel.pp_size} layers [{start}, {end}) "
            f"tp {self.tp_rank}/{self.parallel.tp_size}"
        )
