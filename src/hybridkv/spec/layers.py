"""Layer kinds: what one layer keeps in memory between forward passes.

Invariants:
- Every kind is a frozen value object; two layers with equal kinds have identical geometry.
- Byte sizes are derived from shapes and dtypes, never stored separately.
- ``FullAttention``/``MLA`` keep every token; ``SlidingWindow`` keeps the last ``window``
  tokens before the current position; ``Linear`` keeps a fixed-size state per request;
  ``NoCache`` keeps nothing (e.g. Nemotron-H's MLP-only layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a config dtype name (``"bfloat16"``) to a torch dtype; unknown names raise."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KindTag(StrEnum):
    FULL = "full"
    MLA = "mla"
    SWA = "swa"
    LINEAR = "linear"
    NONE = "none"


@dataclass(frozen=True)
class StateTensor:
    """One named per-request state tensor of a recurrent layer (conv window, SSM state...).

    ``tp_dim`` is the dimension split across tensor-parallel ranks (heads or channels);
    ``None`` means every rank holds a full copy.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_dim: int | None = 0

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


class _KVHeads:
    """K and V heads per token (shared by full and sliding-window attention)."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, **{k: int(v) for k, v in vars(self).items()})

    def elems_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class FullAttention(_KVHeads):
    """MHA/GQA: K and V for every token, ``num_kv_heads`` heads (unsharded count)."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    tag = KindTag.FULL


@dataclass(frozen=True)
class SlidingWindow(_KVHeads):
    """Sliding-window attention: like full attention, but only the last ``window`` tokens."""

    window: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    tag = KindTag.SWA


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (absorbed): one latent ``kv_lora_rank + rope_dim`` a token.

    The latent is shared by all heads, so every TP rank holds all of it.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    num_heads: int = 1
    v_head_dim: int = 0
    tag = KindTag.MLA

    def __post_init__(self) -> None:
        _check_positive("MLA", kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)

    def elems_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class Linear:
    """A recurrent layer (Mamba1/2, GatedDeltaNet, KDA, lightning): fixed-size state."""

    variant: str
    states: tuple[StateTensor, ...]
    tag = KindTag.LINEAR

    def __post_init__(self) -> None:
        if not self.states:
            raise ValueError(f"linear layer {self.variant!r} needs at least one state tensor")
        names = [s.name for s in self.states]
        if len(set(names)) != len(names):
            raise ValueError(f"linear layer {self.variant!r}: duplicate state names {names}")

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.states)


@dataclass(frozen=True)
class NoCache:
    """A layer that keeps nothing between steps (MLP-only blocks)."""

    tag = KindTag.NONE


LayerKind = FullAttention | SlidingWindow | MLA | Linear | NoCache
