"""gpt-oss: alternating sliding/full GQA attention with biases and attention sinks, top-k MoE.

Block: ``x + attn(norm(x))`` then ``x + moe(norm(x))``; plain ``w * x`` RMS norms; one
(YaRN) rope for every layer.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.engine.forward.step import StepContext
from hybridkv.engine.layers.attention import PagedAttention
from hybridkv.engine.layers.mlp import GptOssMoE
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.engine.layers.rope import Rope, RopeTables
from hybridkv.engine.models.base import Block, CausalLM
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel
from hybridkv.memory import UnifiedMemory


class GptOssBlock(Block):
    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.self_attn = PagedAttention(
            layer_id,
            h,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            scaling=config.head_dim**-0.5,
            bias=config.attention_bias,
            sinks=True,
            tp=tp,
        )
        self.mlp = GptOssMoE(
            h,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.swiglu_alpha,
            config.swiglu_limit,
            tp,
        )
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory, rope: RopeTables) -> torch.Tensor:
        x = x + self.tp.reduce(self.self_attn(self.input_layernorm(x), ctx, mem, rope))
        return x + self.tp.reduce(self.mlp(self.post_attention_layernorm(x)))


class GptOss(CausalLM):
    WEIGHT_MAP = ((r"^model\.", ""), (r"\.mlp\.experts\.", ".mlp."))

    def __init__(self, config: Any, layers: tuple[int, int] | None = None, tp: TensorParallel = SINGLE):
        super().__init__(config, layers, tp)
        self.ropes["default"] = Rope(config.rope_parameters, config.head_dim, config.max_position_embeddings)
        for i in self.layer_ids:
            self.layers[str(i)] = GptOssBlock(config, i, tp)
        self.layer_rope = ["default"] * len(self.layer_ids)
        self.norm = self.final(RMSNorm(config.hidden_size, config.rms_norm_eps))
