"""ModelSpec: the ordered layers of one model, with global layer ids and the KV dtype.

Invariants:
- Global layer ids are ``0 .. num_layers-1`` in order; every later package names a layer
  by this id, never by its position inside a pipeline stage or a pool.
- Every pool id of the layers keeps its history rule's invariants (``PoolId.check_rule`` over
  the lengths up to ``max_context``, at most ``CHECKED_LENGTHS``): a rule that breaks one is
  refused here, before memory or the engine reads it.
- Derived byte sizes (per token for attention kinds, per request for recurrent state) are
  computed from the layer kinds and dtypes, for the unsharded model (TP = 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hybridkv.spec.layers import LayerKind
from hybridkv.spec.pools import CHECKED_LENGTHS, PoolId, WindowPool


@dataclass(frozen=True)
class Layer:
    layer_id: int
    kind: LayerKind

    @property
    def tag(self) -> str:
        return self.kind.tag


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: tuple[Layer, ...]
    kv_dtype: torch.dtype = torch.bfloat16
    max_context: int = 131072
    source: str = ""
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"model {self.name!r} has no layers")
        ids = [layer.layer_id for layer in self.layers]
        if ids != list(range(len(ids))):
            raise ValueError(
                f"model {self.name!r}: layer ids must be 0..{len(ids) - 1} in order, got "
                f"{ids[:8]}{'...' if len(ids) > 8 else ''}"
            )
        if self.max_context <= 0:
            raise ValueError(f"model {self.name!r}: max_context must be positive")
        for pool in self.pool_ids():
            pool.check_rule(min(self.max_context, CHECKED_LENGTHS))

    @classmethod
    def from_kinds(cls, name: str, kinds: Iterable[LayerKind], **kw: object) -> ModelSpec:
        """Build a spec from the per-layer kinds, numbering layers 0.. in order."""
        layers = tuple(Layer(i, kind) for i, kind in enumerate(kinds))
        return cls(name=name, layers=layers, **kw)  # type: ignore[arg-type]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, layer_id: int) -> Layer:
        if not 0 <= layer_id < len(self.layers):
            raise KeyError(f"model {self.name!r} has layers 0..{self.num_layers - 1}, not {layer_id}")
        return self.layers[layer_id]

    def layer_ids(self, tag: str) -> list[int]:
        return [layer.layer_id for layer in self.layers if layer.tag == tag]

    def tags(self) -> set[str]:
        return {layer.tag for layer in self.layers}

    def pool_ids(self) -> list[PoolId]:
        """Distinct pools the model's layers need, in pool order."""
        pools = {layer.kind.pool_id for layer in self.layers}
        return sorted((p for p in pools if p is not None), key=PoolId.sort_key)

    def windows(self) -> list[int]:
        """Distinct sliding windows, ascending."""
        return [pool.window for pool in self.pool_ids() if isinstance(pool, WindowPool)]

    def kv_bytes_per_token(self, tag: str) -> int:
        """KV bytes one token costs across all layers of ``tag`` (unsharded)."""
        return sum(layer.kind.bytes_per_token(self.kv_dtype) for layer in self.layers if layer.tag == tag)

    def state_bytes_per_request(self) -> int:
        """State bytes one request holds across all layers with per-request state (unsharded)."""
        return sum(layer.kind.bytes_per_request(self.kv_dtype) for layer in self.layers)

    def recompute_flops_per_token(self, pool: PoolId, position: int) -> int:
        """Estimated FLOPs to rebuild one token's values in every layer of ``pool`` at
        ``position`` (see ``LayerKind.recompute_flops_per_token``; unsharded)."""
        return sum(
            layer.kind.recompute_flops_per_token(position) for layer in self.layers if layer.kind.pool_id == pool
        )

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[str(layer.tag)] = counts.get(str(layer.tag), 0) + 1
        parts = ", ".join(f"{n} {t}" for t, n in counts.items())
        return f"{self.name}: {self.num_layers} layers ({parts})"
