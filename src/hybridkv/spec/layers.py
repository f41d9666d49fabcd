"""Layer kinds: what one layer keeps in memory between forward passes, and every behaviour
that follows from it.

Each kind class is the one place its behaviour is written (see the checklist in
``hybridkv.spec``): its pool id (which carries the history rule), the tensors it packs into
one cell of that pool, bytes per token or per request, how a TP rank shards it, and a
recompute cost. Memory, the planner, the prefix cache and transfer ask the kind (or its
pool id) instead of branching on the class.

Invariants:
- Every kind is a frozen value object; two layers with equal kinds have identical geometry.
- Byte sizes are derived from shapes and dtypes, never stored separately.
- ``FullAttention``/``MLA`` keep every token; ``SlidingWindow`` keeps the last ``window``
  tokens before the current position; ``Linear`` keeps a fixed-size state per request;
  ``NoCache`` keeps nothing (e.g. Nemotron-H's MLP-only layers).
- ``cell_tensors`` of a sharded kind (``shard``) give this rank's shapes; each tensor's
  ``tp_dim`` names the dimension split across TP ranks (None: replicated).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, Protocol

import torch

from hybridkv.registry import Registry
from hybridkv.spec.pools import FULL_POOL, MLA_POOL, RECURRENT_POOL, IdSpace, PoolId, WindowPool


class TensorSplit(Protocol):
    """How a layer kind is split over tensor-parallel ranks (``spec.parallel.Parallel`` is one)."""

    @property
    def tp_size(self) -> int: ...

    def kv_head_range(self, num_kv_heads: int, tp_rank: int) -> tuple[int, int]: ...


_DTYPES = Registry[torch.dtype](
    "dtype",
    {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
        "int8": torch.int8,
        "uint8": torch.uint8,
    },
)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a config dtype name (``"bfloat16"``) to a torch dtype; unknown names raise."""
    if isinstance(name, torch.dtype):
        return name
    return _DTYPES[name]  # UnknownName (a ValueError) naming the known dtypes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KindTag(StrEnum):
    FULL = "full"
    MLA = "mla"
    SWA = "swa"
    LINEAR = "linear"
    NONE = "none"


@dataclass(frozen=True)
class CellTensor:
    """One tensor of one layer inside a cell of its pool (a page of tokens, or one slot)."""

    name: str  # "k", "v", "latent", or a state tensor's name
    dtype: torch.dtype
    shape: tuple[int, ...]
    tp_dim: int | None
    """Dimension of ``shape`` split across TP ranks; None: every rank holds all of it."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class StateTensor:
    """One named per-request state tensor of a recurrent layer (conv window, SSM state...).

    ``tp_dim`` is the dimension split across tensor-parallel ranks (the channels of a conv
    window, the heads of a recurrent matrix); ``None`` means every rank holds a full copy.
    It has no default: each tensor states its own split.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_dim: int | None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("state tensor needs a name")
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise ValueError(f"state tensor {self.name!r}: shape {self.shape} must be positive")
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(self.shape):
            raise ValueError(f"state tensor {self.name!r}: tp_dim {self.tp_dim} outside shape {self.shape}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def shard(self, tp_size: int) -> StateTensor:
        """This tensor as one of ``tp_size`` ranks holds it."""
        if self.tp_dim is None or tp_size == 1:
            return self
        dim = self.shape[self.tp_dim]
        if dim % tp_size:
            raise ValueError(
                f"state tensor {self.name!r}: dim {self.tp_dim} of shape {self.shape} "
                f"({dim}) is not divisible by TP size {tp_size}; choose a TP size that "
                f"divides {dim}"
            )
        shape = list(self.shape)
        shape[self.tp_dim] = dim // tp_size
        return StateTensor(self.name, tuple(shape), self.dtype, self.tp_dim)


def _check_positive(owner: str, **values: int) -> None:
    for key, value in values.items():
        if int(value) <= 0:
            raise ValueError(f"{owner}: {key} must be positive, got {value}")


class LayerKind(ABC):
    """Base of every layer kind: the behaviour each kind owns."""

    tag: ClassVar[str]
    """A ``KindTag`` for the built-in kinds; a new kind names itself."""

    @property
    @abstractmethod
    def pool_id(self) -> PoolId | None:
        """The pool this layer's memory lives in (None: it keeps nothing)."""

    @abstractmethod
    def cell_tensors(self, cell_tokens: int, kv_dtype: torch.dtype) -> tuple[CellTensor, ...]:
        """The tensors this layer packs into one cell of its pool, in order.

        ``cell_tokens``: tokens per cell (the page size; 1 for a slot pool).
        """

    @abstractmethod
    def shard(self, parallel: TensorSplit, tp_rank: int) -> LayerKind:
        """This kind as TP rank ``tp_rank`` holds it (heads / state dims divided)."""

    @abstractmethod
    def recompute_flops_per_token(self, position: int) -> int:
        """Estimated FLOPs this layer spends rebuilding one token's cached values when the
        token at ``position`` is computed again (used by cost-aware eviction).

        Attention kinds count the score and value products against the history their
        rule keeps (a lower bound: projections, which every kind pays alike, are left
        out); recurrent kinds count one multiply-add (2 FLOPs) per state element.
        """

    def bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        """Bytes one token costs in this layer (0 for kinds without per-token memory)."""
        pool = self.pool_id
        if pool is None or pool.id_space is not IdSpace.PAGE:
            return 0
        return sum(t.nbytes for t in self.cell_tensors(1, kv_dtype))

    def bytes_per_request(self, kv_dtype: torch.dtype) -> int:
        """Bytes one request's state costs in this layer (0 for token kinds)."""
        pool = self.pool_id
        if pool is None or pool.id_space is not IdSpace.SLOT:
            return 0
        return sum(t.nbytes for t in self.cell_tensors(1, kv_dtype))

    def attended(self, position: int) -> int:
        """Tokens the token at ``position`` reads under this kind's history rule."""
        pool = self.pool_id
        return 0 if pool is None else position + 1 - pool.first_needed(position + 1)


class KVHeads(LayerKind):
    """Attention that keeps K and V per token in ``num_kv_heads`` heads (split over TP)."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, **{k: int(v) for k, v in vars(self).items()})

    def elems_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)

    def cell_tensors(self, cell_tokens: int, kv_dtype: torch.dtype) -> tuple[CellTensor, ...]:
        return (
            CellTensor("k", kv_dtype, (cell_tokens, self.num_kv_heads, self.head_dim), 1),
            CellTensor("v", kv_dtype, (cell_tokens, self.num_kv_heads, self.v_head_dim), 1),
        )

    def shard(self, parallel: TensorSplit, tp_rank: int) -> LayerKind:
        start, end = parallel.kv_head_range(self.num_kv_heads, tp_rank)
        return dataclasses.replace(self, num_kv_heads=end - start)  # type: ignore[type-var]

    def recompute_flops_per_token(self, position: int) -> int:
        return 2 * self.elems_per_token() * self.attended(position)


@dataclass(frozen=True)
class FullAttention(KVHeads):
    """MHA/GQA: K and V for every token, ``num_kv_heads`` heads (unsharded count)."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    tag: ClassVar[str] = KindTag.FULL

    @property
    def pool_id(self) -> PoolId | None:
        return FULL_POOL


@dataclass(frozen=True)
class SlidingWindow(KVHeads):
    """Sliding-window attention: like full attention, but only the last ``window`` tokens."""

    window: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    tag: ClassVar[str] = KindTag.SWA

    @property
    def pool_id(self) -> PoolId | None:
        return WindowPool(self.window)


@dataclass(frozen=True)
class MLA(LayerKind):
    """Multi-head latent attention (absorbed): one latent ``kv_lora_rank + rope_dim`` a token.

    The latent is shared by all heads, so every TP rank holds all of it.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    num_heads: int = 1
    v_head_dim: int = 0
    tag: ClassVar[str] = KindTag.MLA

    def __post_init__(self) -> None:
        _check_positive("MLA", kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)

    @property
    def pool_id(self) -> PoolId | None:
        return MLA_POOL

    def elems_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cell_tensors(self, cell_tokens: int, kv_dtype: torch.dtype) -> tuple[CellTensor, ...]:
        return (CellTensor("latent", kv_dtype, (cell_tokens, 1, self.elems_per_token()), None),)

    def shard(self, parallel: TensorSplit, tp_rank: int) -> LayerKind:
        return self

    def recompute_flops_per_token(self, position: int) -> int:
        # absorbed: scores against rank + rope, values out of the rank, per query head
        return 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim) * self.attended(position)


@dataclass(frozen=True)
class Linear(LayerKind):
    """A recurrent layer (Mamba1/2, GatedDeltaNet, KDA, lightning): fixed-size state."""

    variant: str
    states: tuple[StateTensor, ...]
    tag: ClassVar[str] = KindTag.LINEAR

    def __post_init__(self) -> None:
        if not self.states:
            raise ValueError(f"linear layer {self.variant!r} needs at least one state tensor")
        names = [s.name for s in self.states]
        if len(set(names)) != len(names):
            raise ValueError(f"linear layer {self.variant!r}: duplicate state names {names}")

    @property
    def pool_id(self) -> PoolId | None:
        return RECURRENT_POOL

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.states)

    def cell_tensors(self, cell_tokens: int, kv_dtype: torch.dtype) -> tuple[CellTensor, ...]:
        return tuple(CellTensor(s.name, s.dtype, s.shape, s.tp_dim) for s in self.states)

    def shard(self, parallel: TensorSplit, tp_rank: int) -> LayerKind:
        return Linear(self.variant, tuple(s.shard(parallel.tp_size) for s in self.states))

    def recompute_flops_per_token(self, position: int) -> int:
        return 2 * sum(math.prod(s.shape) for s in self.states)


@dataclass(frozen=True)
class NoCache(LayerKind):
    """A layer that keeps nothing between steps (MLP-only blocks)."""

    tag: ClassVar[str] = KindTag.NONE

    @property
    def pool_id(self) -> PoolId | None:
        return None

    def cell_tensors(self, cell_tokens: int, kv_dtype: torch.dtype) -> tuple[CellTensor, ...]:
        return ()

    def shard(self, parallel: TensorSplit, tp_rank: int) -> LayerKind:
        return self

    def recompute_flops_per_token(self, position: int) -> int:
        return 0
