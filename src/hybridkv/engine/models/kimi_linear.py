"""Kimi-Linear: KDA linear-attention layers interleaved with MLA (NoPE) layers; MoE MLPs.

Block: ``x + mixer(input_norm(x))`` then ``x + mlp(post_attn_norm(x))``; plain ``w * x``
RMS norms. The mixer is KDA on ``linear_attention`` layers and MLA over the paged latent
pool on ``full_attention`` layers; the MLP is the group-limited MoE (gated experts plus
``n_shared_experts`` shared) where ``mlp_layer_types`` says ``sparse``, else a gated MLP.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.engine.errors import WeightError
from hybridkv.engine.forward.step import StepContext
from hybridkv.engine.layers.grouped_moe import GroupLimitedMoE, GroupLimitedRouter, RoutedExperts, fuse_expert_weights
from hybridkv.engine.layers.kda import KimiDeltaAttention
from hybridkv.engine.layers.mla import PagedMLA
from hybridkv.engine.layers.mlp import GatedMLP, activation
from hybridkv.engine.layers.nope import NoRope
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.engine.layers.rope import RopeTables
from hybridkv.engine.models.base import Block, CausalLM, Fused
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel
from hybridkv.memory import UnifiedMemory


def _moe(config: Any, tp: TensorParallel) -> GroupLimitedMoE:
    h, inter = config.hidden_size, config.moe_intermediate_size
    router = GroupLimitedRouter(
        h,
        config.num_local_experts,
        config.num_experts_per_tok,
        config.n_group,
        config.topk_group,
        config.norm_topk_prob,
        config.routed_scaling_factor,
    )
    experts = RoutedExperts(h, inter, config.num_local_experts, activation(config.hidden_act), gated=True, tp=tp)
    shared = GatedMLP(h, inter * config.n_shared_experts, config.hidden_act, tp=tp)
    return GroupLimitedMoE(router, experts, shared, tp=tp)


class KimiLinearBlock(Block):
    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.linear = config.layer_types[layer_id] == "linear_attention"
        self.self_attn: nn.Module = (
            KimiDeltaAttention(config, layer_id, tp) if self.linear else PagedMLA(config, layer_id, tp)
        )
        sparse = config.mlp_layer_types[layer_id] == "sparse"
        self.mlp: nn.Module = (
            _moe(config, tp) if sparse else GatedMLP(h, config.intermediate_size, config.hidden_act, tp=tp)
        )
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory, rope: RopeTables) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixed = self.self_attn(h, ctx, mem) if self.linear else self.self_attn(h, ctx, mem, rope)
        x = x + self.tp.reduce(mixed)
        return x + self.tp.reduce(self.mlp(self.post_attention_layernorm(x)))


_SPLIT_CONV = re.compile(r"^(.*\.self_attn\.)([qkv])_conv1d\.weight$")


def _fuse_conv(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` -> one ``conv1d`` over q|k|v channels."""
    out: dict[str, torch.Tensor] = {}
    split: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _SPLIT_CONV.match(name)
        if match is None:
            out[name] = tensor
        else:
            split.setdefault(match[1], {})[match[2]] = tensor
    for prefix, parts in split.items():
        lacking = [f"{prefix}{p}_conv1d.weight" for p in "qkv" if p not in parts]
        if lacking:
            raise WeightError(f"missing conv weights {', '.join(lacking)}")
        out[f"{prefix}conv1d.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


class KimiLinear(CausalLM):
    # Checkpoint names (Moonshot's layout) -> transformers' state_dict names -> this module's.
    WEIGHT_MAP = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)", r".self_attn.forget_gate.\1"),
        (r"^model\.", ""),
    )
    FUSED = (  # merge_checkpoint
        Fused(r"^(.*\.self_attn\.)(?P<part>[qkv])_conv1d\.weight$", r"\1conv1d.weight", ("q", "k", "v"), False),
        Fused(r"^(.*)\.experts\.\d+\.(?P<part>w1|w3)\.weight$", r"\1.experts.gate_up_proj", ("w1", "w3"), True),
        Fused(r"^(.*)\.experts\.\d+\.(?P<part>w2)\.weight$", r"\1.experts.down_proj", ("w2",), True),
    )

    def __init__(self, config: Any, layers: tuple[int, int] | None = None, tp: TensorParallel = SINGLE):
        super().__init__(config, layers, tp)
        self.ropes["none"] = NoRope()
        for i in self.layer_ids:
            self.layers[str(i)] = KimiLinearBlock(config, i, tp)
        self.layer_rope = ["none"] * len(self.layer_ids)
        self.norm = self.final(RMSNorm(config.hidden_size, config.rms_norm_eps))

    def merge_checkpoint(self, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Stack per-expert ``w1|w3`` (gate|up) and ``w2`` (down) and fuse the split q/k/v convs."""
        return fuse_expert_weights(_fuse_conv(tensors), {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)})
