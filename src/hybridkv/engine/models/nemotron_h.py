"""Nemotron-H: Mamba2, attention, MLP and MoE layers in the order of ``hybrid_override_pattern``.

Every layer is one pre-norm residual block ``x + mixer(norm(x))`` whose mixer is the
layer's single kind (``layer_types``: ``linear_attention`` = Mamba2 ``M``,
``full_attention`` = GQA attention ``*`` without positional encoding, ``mlp`` = ``-``,
``moe`` = ``E``). Plain ``w * x`` RMS norms; MLPs are ``down(act(up(x)))`` (``relu2``);
the MoE uses the group-limited sigmoid router, plain experts, a shared expert and optional
latent projections.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.engine.forward.step import StepContext
from hybridkv.engine.layers.attention import PagedAttention
from hybridkv.engine.layers.grouped_moe import GroupLimitedMoE, GroupLimitedRouter, RoutedExperts, fuse_expert_weights
from hybridkv.engine.layers.linear import Linear
from hybridkv.engine.layers.mamba2 import Mamba2Mixer
from hybridkv.engine.layers.mlp import activation
from hybridkv.engine.layers.nope import NoRope
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.engine.layers.rope import RopeTables
from hybridkv.engine.models.base import Block, CausalLM, Fused
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel
from hybridkv.memory import UnifiedMemory


class UpDownMLP(nn.Module):
    """``down(act(up(x)))``."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        mine = tp.split(intermediate, "MLP intermediate size")
        self.up_proj = Linear(hidden, mine[1] - mine[0], bias=bias)
        self.down_proj = Linear(mine[1] - mine[0], hidden, bias=bias)
        self.act = activation(act)
        tp.column(self.up_proj, [mine], intermediate)
        tp.row(self.down_proj, [mine], intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def _moe(config: Any, tp: TensorParallel) -> GroupLimitedMoE:
    h, latent = config.hidden_size, config.moe_latent_size
    router = GroupLimitedRouter(
        h,
        config.n_routed_experts,
        config.num_experts_per_tok,
        config.n_group,
        config.topk_group,
        config.norm_topk_prob,
        config.routed_scaling_factor,
    )
    experts = RoutedExperts(
        h if latent is None else latent,
        config.moe_intermediate_size,
        config.n_routed_experts,
        activation(config.mlp_hidden_act),
        gated=False,
        tp=tp,
    )
    shared = UpDownMLP(h, config.moe_shared_expert_intermediate_size, config.mlp_hidden_act, config.mlp_bias, tp)
    projections = (
        None if latent is None else (Linear(h, latent, bias=config.mlp_bias), Linear(latent, h, bias=config.mlp_bias))
    )
    return GroupLimitedMoE(router, experts, shared, projections, tp)


class NemotronHBlock(Block):
    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.kind = config.layer_types[layer_id]
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        h = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        if self.kind == "linear_attention":
            self.mixer: nn.Module = Mamba2Mixer(config, layer_id, tp)
        elif self.kind == "full_attention":
            self.mixer = PagedAttention(
                layer_id,
                h,
                config.num_attention_heads,
                config.num_key_value_heads,
                head_dim,
                scaling=head_dim**-0.5,
                tp=tp,
            )
        elif self.kind == "mlp":
            self.mixer = UpDownMLP(h, config.intermediate_size, config.mlp_hidden_act, config.mlp_bias, tp)
        elif self.kind == "moe":
            self.mixer = _moe(config, tp)
        else:
            raise ValueError(
                f"nemotron_h layer {layer_id}: unknown layer type {self.kind!r} "
                "(known: linear_attention, full_attention, mlp, moe)"
            )

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory, rope: RopeTables) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "linear_attention":
            return x + self.tp.reduce(self.mixer(h, ctx, mem))
        if self.kind == "full_attention":
            return x + self.tp.reduce(self.mixer(h, ctx, mem, rope))
        return x + self.tp.reduce(self.mixer(h))


class NemotronH(CausalLM):
    # transformers names the trunk ``model.``; its save_pretrained and NVIDIA's checkpoints name it ``backbone.``.
    WEIGHT_MAP = (
        (r"^mtp\.", None),
        (r"^(model|backbone)\.embeddings\.", "embed_tokens."),
        (r"^(model|backbone)\.norm_f\.", "norm."),
        (r"^(model|backbone)\.", ""),
    )
    FUSED = (  # merge_checkpoint
        Fused(r"^(.*)\.experts\.\d+\.(?P<part>up_proj)\.weight$", r"\1.experts.up_proj", ("up_proj",), True),
        Fused(r"^(.*)\.experts\.\d+\.(?P<part>down_proj)\.weight$", r"\1.experts.down_proj", ("down_proj",), True),
    )

    def __init__(self, config: Any, layers: tuple[int, int] | None = None, tp: TensorParallel = SINGLE):
        super().__init__(config, layers, tp)
        self.ropes["none"] = NoRope()
        for i in self.layer_ids:
            self.layers[str(i)] = NemotronHBlock(config, i, tp)
        self.layer_rope = ["none"] * len(self.layer_ids)
        self.norm = self.final(RMSNorm(config.hidden_size, config.layer_norm_epsilon))

    def merge_checkpoint(self, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Checkpoints keep one ``up_proj`` / ``down_proj`` per expert; stack them."""
        return fuse_expert_weights(tensors, {"up_proj": ("up_proj",), "down_proj": ("down_proj",)})
