"""Mixture of experts with DeepSeek-V3's group-limited sigmoid router (Kimi-Linear, Nemotron-H).

Router: ``scores = sigmoid(x W)``; experts are chosen by ``scores + e_score_correction_bias``
among the best ``topk_group`` of ``n_group`` groups (a group ranks by its two best
scores); the chosen experts weigh in with their *uncorrected* scores, renormalised when
``norm_topk_prob`` and multiplied by ``routed_scaling_factor``. A shared expert always adds
its output.

Invariants: routing is computed in fp32 like the reference; experts are routed
(``routing.Routing``: each token through its top-k experts only, grouped by expert), with no
per-expert Python loop and no host sync; names of parameters equal
transformers' ``state_dict`` (``gate.weight``, ``gate.e_score_correction_bias``,
``experts.gate_up_proj`` / ``experts.up_proj``, ``experts.down_proj``, ``shared_experts.*``);
checkpoints that store one tensor per expert are stacked by ``fuse_expert_weights``.
Tensor parallel (``tp``): experts and the shared expert keep their columns of the
intermediate size, the router and ``fc1_latent_proj`` are replicated, ``fc2_latent_proj``'s
bias lives on rank 0 only: the output is the rank's partial sum.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.errors import WeightError
from hybridkv.engine.layers.linear import expert_weights
from hybridkv.engine.layers.routing import Routing
from hybridkv.engine.ops.cast import cast, f32
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel, shifted


class GroupLimitedRouter(nn.Module):
    def __init__(
        self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int, norm: bool, scale: float
    ):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"router: {num_experts} experts do not split into n_group={n_group} equal groups")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        # A checkpoint weight (a buffer in transformers): a Parameter so the weight loader places it.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.num_experts, self.top_k, self.n_group, self.topk_group = num_experts, top_k, n_group, topk_group
        self.norm, self.scale = norm, scale

    def forward(self, x: torch.Tensor) -> Routing:
        """Each token's top-k experts and their weights (fp32)."""
        scores = F.linear(f32(x), f32(self.weight)).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        index = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing.of(index, weights * self.scale, self.num_experts)


class RoutedExperts(nn.Module):
    """``E`` expert MLPs, each on the tokens routed to it: gated (``act(gate) * up``, Kimi) or plain (``act(up)``,
    Nemotron-H)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        gated: bool,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.gated, self.act = gated, act
        mine = tp.split(intermediate, "MoE expert intermediate size")
        local = mine[1] - mine[0]
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden))
            tp.param(self, "gate_up_proj", 1, [mine, *shifted([mine], intermediate)], 2 * intermediate)
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, local, hidden))
            tp.param(self, "up_proj", 1, [mine], intermediate)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, local))
        tp.param(self, "down_proj", 2, [mine], intermediate)

    def forward(self, x: torch.Tensor, route: Routing) -> torch.Tensor:
        """``x (T, H)`` -> ``(T, H)`` in the routing weights' dtype."""
        rows = route.gather(x)
        if self.gated:
            packed = expert_weights(rows, self.gate_up_proj, self, "_packed_gate_up")
            gate, up = route.matmul(rows, self.gate_up_proj.transpose(1, 2), packed=packed).chunk(2, dim=-1)
            inner = self.act(gate) * up
        else:
            packed = expert_weights(rows, self.up_proj, self, "_packed_up")
            inner = self.act(route.matmul(rows, self.up_proj.transpose(1, 2), packed=packed))
        packed = expert_weights(inner, self.down_proj, self, "_packed_down")
        out = route.matmul(inner, self.down_proj.transpose(1, 2), packed=packed)
        return route.combine(cast(out, route.weight.dtype), x.shape[0])


class GroupLimitedMoE(nn.Module):
    """``shared_experts(x) + fc2(experts(fc1(x), router(x)))`` (``fc1``/``fc2``: optional latent projections)."""

    def __init__(
        self,
        router: GroupLimitedRouter,
        experts: RoutedExperts,
        shared_experts: nn.Module,
        latent: tuple[nn.Module, nn.Linear] | None = None,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.gate, self.experts, self.shared_experts = router, experts, shared_experts
        self.fc1_latent_proj: nn.Module = nn.Identity()
        self.fc2_latent_proj: nn.Module = nn.Identity()
        if latent is not None:
            self.fc1_latent_proj, self.fc2_latent_proj = latent
            if latent[1].bias is not None:
                tp.zeros_off_rank0(latent[1], "bias")  # applied to a partial sum: its bias once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = cast(self.experts(self.fc1_latent_proj(x), self.gate(x)), x.dtype)
        return self.fc2_latent_proj(routed) + self.shared_experts(x)


_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight$")


def fuse_expert_weights(
    tensors: Mapping[str, torch.Tensor], fused: dict[str, tuple[str, ...]]
) -> dict[str, torch.Tensor]:
    """Checkpoint per-expert weights -> the stacked ``experts.<fused>`` tensors ``(E, ...)``.

    ``fused`` maps a stacked name to the per-expert parts concatenated (dim 0) into it, e.g.
    Kimi ``{"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}``. Names that are not per-expert
    pass through (a ``state_dict`` is already stacked). Every expert ``0..E-1`` needs every part.
    """
    parts = {part for group in fused.values() for part in group}
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.match(name)
        if match is None or match[3] not in parts:
            out[name] = tensor
        else:
            experts.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = tensor
    for prefix, by_index in experts.items():
        lacking = [
            f"{prefix}.experts.{e}.{part}.weight"
            for e in range(max(by_index) + 1)
            for part in sorted(parts)
            if part not in by_index.get(e, {})
        ]
        if lacking:
            raise WeightError(f"missing expert weights {', '.join(lacking[:6])}")
        for stacked, group in fused.items():
            out[f"{prefix}.experts.{stacked}"] = torch.stack(
                [torch.cat([by_index[e][part] for part in group]) for e in range(len(by_index))]
            )
    return out
