"""Gemma 3 (text): full + sliding-window attention, sandwich norms, local/global rope bases.

Block: ``x + post_attn_norm(attn(input_norm(x)))`` then ``x + post_ff_norm(mlp(pre_ff_norm(x)))``;
norms are ``(1 + w)`` RMS norms, embeddings are scaled by ``sqrt(hidden)``, q/k heads are
RMS-normed, sliding layers use the ``sliding_attention`` rope, full layers the
``full_attention`` one; optional final logit soft-capping. ``attn_logit_softcapping`` is a
config field Gemma 3 keeps but does not apply (transformers 5.23.0's Gemma 3 attention
ignores it, and so does this one).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.engine.forward.step import StepContext
from hybridkv.engine.layers.attention import PagedAttention
from hybridkv.engine.layers.mlp import GatedMLP
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.engine.layers.rope import Rope, RopeTables
from hybridkv.engine.models.base import Block, CausalLM
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel
from hybridkv.memory import UnifiedMemory


class Gemma3Block(Block):
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
            scaling=config.query_pre_attn_scalar**-0.5,
            bias=config.attention_bias,
            qk_norm_eps=eps,
            tp=tp,
        )
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_activation, tp=tp)
        self.input_layernorm = RMSNorm(h, eps, offset=True)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=True)

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory, rope: RopeTables) -> torch.Tensor:
        attn = self.tp.reduce(self.self_attn(self.input_layernorm(x), ctx, mem, rope))
        x = self.post_attention_layernorm(attn, residual=x)  # x + norm(attn)
        return self.post_feedforward_layernorm(self.tp.reduce(self.mlp(self.pre_feedforward_layernorm(x))), residual=x)


class Gemma3(CausalLM):
    def __init__(self, config: Any, layers: tuple[int, int] | None = None, tp: TensorParallel = SINGLE):
        super().__init__(config, layers, tp)
        types = [config.layer_types[i] for i in self.layer_ids]
        for layer_type in sorted(set(types)):
            self.ropes[layer_type] = Rope(
                config.rope_parameters[layer_type], config.head_dim, config.max_position_embeddings
            )
        for i in self.layer_ids:
            self.layers[str(i)] = Gemma3Block(config, i, tp)
        self.layer_rope = types
        self.norm = self.final(RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True))
        self.embed_scale = float(config.hidden_size**0.5)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        out = super().logits(x)
        cap = self.config.final_logit_softcapping
        return out if cap is None else torch.tanh(out / cap) * cap
