"""Qwen3-Next: GatedDeltaNet layers interleaved with gated full attention, sparse MoE with a shared expert.

Block: ``x + mixer(input_norm(x))`` then ``x + mlp(post_attn_norm(x))``; ``(1 + w)`` RMS
norms; the mixer is GatedDeltaNet on ``linear_attention`` layers and output-gated GQA
attention with q/k norms and partial RoPE on ``full_attention`` layers; the MLP is the
sparse MoE block except on ``mlp_only_layers`` / off the ``decoder_sparse_step`` grid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.engine.forward.step import StepContext
from hybridkv.engine.layers.attention import PagedAttention
from hybridkv.engine.layers.gdn import GatedDeltaNet
from hybridkv.engine.layers.grouped_moe import fuse_expert_weights
from hybridkv.engine.layers.mlp import GatedMLP, SoftmaxTopKMoE
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.engine.layers.rope import Rope, RopeTables
from hybridkv.engine.models.base import Block, CausalLM, Fused
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel
from hybridkv.memory import UnifiedMemory


class Qwen3NextBlock(Block):
    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.linear = config.layer_types[layer_id] == "linear_attention"
        self.linear_attn = GatedDeltaNet(config, layer_id, tp) if self.linear else None
        self.self_attn = (
            None
            if self.linear
            else PagedAttention(
                layer_id,
                h,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                scaling=config.head_dim**-0.5,
                bias=config.attention_bias,
                qk_norm_eps=eps,
                output_gate=True,
                tp=tp,
            )
        )
        sparse = (
            layer_id not in (config.mlp_only_layers or [])
            and config.num_experts > 0
            and (layer_id + 1) % config.decoder_sparse_step == 0
        )
        self.mlp: nn.Module = (
            SoftmaxTopKMoE(
                h,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                config.hidden_act,
                config.shared_expert_intermediate_size,
                tp,
            )
            if sparse
            else GatedMLP(h, config.intermediate_size, config.hidden_act, tp=tp)
        )
        self.input_layernorm = RMSNorm(h, eps, offset=True)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=True)

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory, rope: RopeTables) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            x = x + self.tp.reduce(self.linear_attn(h, ctx, mem))
        elif self.self_attn is not None:
            x = x + self.tp.reduce(self.self_attn(h, ctx, mem, rope))
        return x + self.tp.reduce(self.mlp(self.post_attention_layernorm(x)))


class Qwen3Next(CausalLM):
    WEIGHT_MAP = ((r"^model\.", ""), (r"\.mlp\.experts\.", ".mlp."), (r"^mtp\.", None))
    FUSED = (  # what merge_checkpoint fuses
        Fused(
            r"^(.*)\.experts\.\d+\.(?P<part>gate_proj|up_proj)\.weight$",
            r"\1.experts.gate_up_proj",
            ("gate_proj", "up_proj"),
            True,
        ),
        Fused(r"^(.*)\.experts\.\d+\.(?P<part>down_proj)\.weight$", r"\1.experts.down_proj", ("down_proj",), True),
    )

    def __init__(self, config: Any, layers: tuple[int, int] | None = None, tp: TensorParallel = SINGLE):
        super().__init__(config, layers, tp)
        self.ropes["default"] = Rope(config.rope_parameters, config.head_dim, config.max_position_embeddings)
        for i in self.layer_ids:
            self.layers[str(i)] = Qwen3NextBlock(config, i, tp)
        self.layer_rope = ["default"] * len(self.layer_ids)
        self.norm = self.final(RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True))

    def merge_checkpoint(self, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return fuse_expert_weights(tensors, {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)})
