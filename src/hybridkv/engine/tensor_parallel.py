"""How one tensor-parallel rank holds a layer: its part of every weight, and the reduce of partial sums.

A sharded layer is built with its *local* sizes (its heads, channels, intermediate
columns) and records, per parameter, which part of the full checkpoint tensor it holds
(``Part``: ranges along one dim, concatenated in order, so a conv over ``q|k|v`` takes its
own q, k and v channels). Column-parallel weights (inputs to heads / channels /
intermediate) are split on their output dim; row-parallel weights (``o_proj``,
``down_proj``, ``out_proj``) on their input dim, so the layer's output is this rank's
*partial sum*.

Invariants:
- A block adds ``reduce(partial)`` to its residual: the sum over the TP group of the
  ranks' partial sums. Biases of row-parallel weights live on TP rank 0 only (``Part.zeros``
  elsewhere), so any affine map applied to a partial sum (a bias, a latent projection, a
  routing weight) still sums to the unsharded result.
- With ``size == 1`` every part is the whole tensor and ``reduce`` is the identity: the
  single-process model computes exactly as before.
- Splits are even; a count that does not divide raises naming the layer, the count and the
  TP size. KV heads follow ``Parallel.kv_head_range`` (GQA heads replicated when TP > heads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.spec import Parallel

Range = tuple[int, int]


@dataclass(frozen=True)
class Part:
    """The ranges ``[start, end)`` of dim ``dim`` of a full tensor (of ``full`` entries there) one rank holds.

    No ranges: the rank holds zeros and reads nothing (a row-parallel bias off rank 0).
    """

    dim: int
    ranges: tuple[Range, ...]
    full: int

    @classmethod
    def zeros(cls) -> Part:
        return cls(0, (), 0)

    @property
    def is_zeros(self) -> bool:
        return not self.ranges

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full ``tensor``; a tensor already of the part's size is returned as is."""
        if tensor.shape[self.dim] == self.size:
            return tensor
        if tensor.shape[self.dim] != self.full:
            raise ValueError(
                f"dim {self.dim} of {tuple(tensor.shape)} is neither the full {self.full} nor the part {self.size}"
            )
        return torch.cat([tensor.narrow(self.dim, a, b - a) for a, b in self.ranges], dim=self.dim)

    def slices(self, ndim: int) -> list[tuple[slice, ...]]:
        """One index per range, for reading only this part from a lazily opened file (safetensors)."""
        lead = (slice(None),) * self.dim
        return [(*lead, slice(a, b), *((slice(None),) * (ndim - self.dim - 1))) for a, b in self.ranges]


def component_part(fused: Part, index: int, count: int, stacked: bool) -> Part:
    """The part of component ``index`` of ``count`` equal components concatenated on dim 0 into ``fused``
    (then stacked over experts on a new leading dim when ``stacked``): what a rank reads of one checkpoint
    tensor that the loader fuses into a sharded parameter (per-expert MoE weights, split q/k/v convs)."""
    dim = fused.dim - 1 if stacked else fused.dim
    if dim != 0:  # split across the components' own dims: every component keeps the same ranges
        return Part(dim, fused.ranges, fused.full)
    size = fused.full // count
    lo, hi = index * size, (index + 1) * size
    return Part(0, tuple((max(a, lo) - lo, min(b, hi) - lo) for a, b in fused.ranges if a < hi and b > lo), size)


def shifted(ranges: Sequence[Range], offset: int) -> list[Range]:
    return [(a + offset, b + offset) for a, b in ranges]


def scaled(r: Range, unit: int) -> Range:
    return r[0] * unit, r[1] * unit


class TensorParallel:
    """This rank's place in a TP group: even splits, parts of weights, and the reduce of partial sums."""

    def __init__(self, size: int = 1, rank: int = 0, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if size > 1 and reduce is None:
            raise ValueError(f"TP size {size} needs a reduce (an all-reduce over the TP group)")
        self.size, self.rank = size, rank
        self.parallel = Parallel(tp_size=size)
        self._reduce = reduce

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``partial`` (identity on one rank)."""
        return partial if self._reduce is None else self._reduce(partial)

    def split(self, count: int, what: str) -> Range:
        """This rank's ``[start, end)`` of ``count`` things split evenly."""
        if count % self.size:
            raise ValueError(
                f"{what}: {count} cannot be split evenly over TP {self.size}; use a TP size that divides {count}"
            )
        per = count // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, count: int) -> Range:
        return self.parallel.kv_head_range(count, self.rank)

    # --- recording parts ---------------------------------------------------------------------------------------------

    @staticmethod
    def mark(module: nn.Module, name: str, part: Part) -> None:
        """Record that ``module.<name>`` holds ``part`` of the checkpoint tensor."""
        parts: dict[str, Part] = module.__dict__.setdefault("tp_parts", {})
        parts[name] = part

    def column(self, linear: nn.Linear, ranges: Sequence[Range], full: int) -> None:
        """``linear`` computes output features ``ranges`` of ``full``: weight and bias split on dim 0."""
        if self.size == 1:
            return
        self.mark(linear, "weight", Part(0, tuple(ranges), full))
        if linear.bias is not None:
            self.mark(linear, "bias", Part(0, tuple(ranges), full))

    def row(self, linear: nn.Linear, ranges: Sequence[Range], full: int) -> None:
        """``linear`` reads input features ``ranges`` of ``full``: weight split on dim 1, bias on rank 0 only."""
        if self.size == 1:
            return
        self.mark(linear, "weight", Part(1, tuple(ranges), full))
        if linear.bias is not None and self.rank != 0:
            self.mark(linear, "bias", Part.zeros())

    def param(self, module: nn.Module, name: str, dim: int, ranges: Sequence[Range], full: int) -> None:
        if self.size > 1:
            self.mark(module, name, Part(dim, tuple(ranges), full))

    def zeros_off_rank0(self, module: nn.Module, name: str) -> None:
        if self.size > 1 and self.rank != 0:
            self.mark(module, name, Part.zeros())


SINGLE = TensorParallel()
"""The unsharded layout (one rank): every layer whole, no reduce."""


def collect_parts(model: nn.Module) -> dict[str, Part]:
    """``{parameter name: Part}`` of every sharded parameter of ``model``."""
    out: dict[str, Part] = {}
    for prefix, module in model.named_modules():
        for name, part in module.__dict__.get("tp_parts", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = part
    return out
