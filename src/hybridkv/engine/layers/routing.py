"""Routed experts: each token's top-k experts run on that token only, grouped by expert.

``Routing.of(index, weights, num_experts)`` sorts the ``T * k`` (token, expert) pairs by expert
(stable: a token's pairs keep their order), so every expert's tokens are one contiguous run
and one ``grouped_mm`` per projection computes every expert's matmul on its own tokens; the
routed outputs are weighted and summed back per token with one ``index_add_`` (``packed_mlp``: one per expert, its
whole MLP run at once).

Packed CPU experts (``linear.expert_weights``) run one call per expert on its run of rows (the skinny kernel for a
row or two, else oneDNN). oneDNN compiles
a kernel for each row count it meets (~4-5 ms for 500 x 512 -> 512 bf16 on this machine, against ~0.35 ms for the
product once compiled), and the runs' lengths differ every step: so a run of more than ``ROW_BUCKET`` rows is
widened to a multiple of it (the rows after it, the next experts' or zeros past the end, computed and dropped) and
the kernels of a few row counts are reused (``fast_paths(row_buckets=...)``; within bf16 rounding: oneDNN may pick
another blocking for another row count). A shorter run keeps its length: a decode's runs of a row or two would cost
several times more widened, and their few lengths are soon all compiled. Projections (``linear.linear``) keep their
exact row counts: a step's token count recurs, their compiles summed ~95 ms over a fresh widened Gemma 3 run, and
widening them cost more than it saved (a 144-token prefill computed as 192 rows).

Invariants: no host read of a device tensor (the runs' ends come from ``searchsorted`` on the
device, never from counting on the host; the packed path reads them, CPU tensors); experts no token chose cost
nothing; each token's output is the sum over its chosen experts, in expert order, of ``weight * expert(x)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.layers.linear import PackedExperts
from hybridkv.engine.ops.cast import cast

ROW_BUCKET = 64
"""Packed expert runs are computed on a multiple of this many rows (the module docstring)."""


def _aligned(*tensors: torch.Tensor) -> bool:
    """Every stride but the unit one a multiple of 16 bytes (what ``grouped_mm`` requires)."""
    return all((stride * t.element_size()) % 16 == 0 for t in tensors for stride in t.stride() if stride != 1)


def _run(x: torch.Tensor, start: int, end: int, experts: PackedExperts, expert: int) -> torch.Tensor:
    """Rows ``x[start:end]`` times an expert's weight; a run of more than ``ROW_BUCKET`` rows computed on a multiple
    of it."""
    rows = end - start
    if FAST.row_buckets and rows > ROW_BUCKET:
        rows = -(-rows // ROW_BUCKET) * ROW_BUCKET
    if start + rows <= x.shape[0]:
        widened = x[start : start + rows]
    else:  # the last runs: zeros after the rows
        widened = x.new_zeros(rows, x.shape[1])
        widened[: end - start] = x[start:end]
    return experts.times(widened, expert)[: end - start]


@dataclass(frozen=True)
class Routing:
    token: torch.Tensor  # (N,) the token of each routed pair, pairs sorted by expert
    expert: torch.Tensor  # (N,) its expert (ascending)
    weight: torch.Tensor  # (N,) its routing weight
    ends: torch.Tensor  # (E,) int32: expert e's pairs are [ends[e - 1], ends[e])

    @classmethod
    def of(cls, index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Routing:
        """``index``, ``weights``: ``(T, k)`` each token's chosen experts and their weights."""
        k = index.shape[1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        expert = flat[order]
        bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=expert.dtype)
        ends = torch.searchsorted(expert, bounds).to(torch.int32)
        return cls(order // k, expert, weights.reshape(-1)[order], ends)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, H)`` -> ``(N, H)``: each pair's token's row (``index_select``: on the CPU about twice as fast as
        indexing with the tensor)."""
        return x.index_select(0, self.token)

    def matmul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: PackedExperts | None = None,
    ) -> torch.Tensor:
        """Each pair's row ``(N, in)`` times its expert's ``weight[e]`` ``(in, out)`` (+ ``bias[e]``): ``(N, out)``.
        ``packed``: the experts' plain and packed weights (``linear.expert_weights``; CPU tensors only): one call per
        expert that has pairs, on its run's rows (the skinny kernel for a row or two, else oneDNN; the expert runs'
        ends read on the host: a CPU tensor)."""
        weight = cast(weight, x.dtype)
        if packed is not None:
            parts, start = [], 0
            for expert, end in enumerate(self.ends.tolist()):
                if end > start:
                    parts.append(_run(x, start, end, packed, expert))
                start = end
            out = torch.cat(parts) if len(parts) != 1 else parts[0]
        elif _aligned(x, weight):
            out = F.grouped_mm(x, weight, offs=self.ends)
        else:  # grouped_mm needs 16-byte aligned strides: odd sizes take each pair's expert weight instead
            out = torch.bmm(x.unsqueeze(1), weight[self.expert]).squeeze(1)
        return out if bias is None else out + cast(bias[self.expert], out.dtype)

    def packed_mlp(
        self,
        rows: torch.Tensor,
        first: PackedExperts,
        second: PackedExperts,
        inner: Callable[[torch.Tensor], torch.Tensor],
        tokens: int,
    ) -> torch.Tensor:
        """``combine(matmul(inner(matmul(rows, first)), second), tokens)`` expert by expert, on packed CPU weights:
        each expert's run through its first projection, ``inner``, its routing weights and its second projection,
        added into its tokens' rows. No tensor of every pair's projections is made: the two concatenations and the
        weighting of the whole ``(N, H)`` output were a third of widened Qwen3-Next's 2048-token MoE layer. The
        weights scale the inner activations, before the second projection: within the dtype's rounding of
        ``combine``'s weighted sum."""
        out = rows.new_zeros(tokens, second.plain.shape[1])
        start = 0
        for expert, end in enumerate(self.ends.tolist()):
            if end > start:
                hidden = inner(_run(rows, start, end, first, expert))
                hidden = hidden * cast(self.weight[start:end, None], hidden.dtype)
                out.index_add_(0, self.token[start:end], _run(hidden, 0, end - start, second, expert))
            start = end
        return out

    def combine(self, y: torch.Tensor, tokens: int) -> torch.Tensor:
        """``(N, H)`` routed outputs -> ``(tokens, H)``: each token's weighted sum over its experts."""
        out = y.new_zeros(tokens, y.shape[1])
        return out.index_add_(0, self.token, y * cast(self.weight[:, None], y.dtype))
