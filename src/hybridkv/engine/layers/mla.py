"""Multi-head latent attention (MLA) over a paged latent pool (Kimi-Linear; DeepSeek-style).

Per token the memory keeps one latent ``[kv_a_layernorm(c_kv) | k_rope]`` of
``kv_lora_rank + qk_rope_head_dim`` elements, shared by every head
(``mem.view(layer_id, "latent")`` ``(cells, page_size, 1, rank + rope)``). Per step: put the
new tokens' latents in the step's gathered context (``pool_io``; the pool gets them at the end
of the step) and attend in the absorbed form (``kv_b_proj`` folded into the queries and the
output: the reference's non-absorbed arithmetic up to summation order) with the step's mask;
one-token spans and longer ones attend as two padded groups (``ctx.groups``).

Tensor parallel (``tp``): the latent is replicated (every rank computes and stores all
of it); the rank holds its query heads: its rows of the query and ``kv_b_proj``
projections and its columns of ``o_proj``, so the output is its partial sum.

Invariants: K/V exist only as latents in the pool; the rope part is rotated (rotate-half)
before it is stored, by the model's rope (Kimi-Linear's MLA is NoPE: a zero-width rope
leaves it unchanged); unwritten context slots are zero and masked.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.forward.step import StepContext
from hybridkv.engine.layers.linear import Linear
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.engine.layers.rope import RopeTables, apply_rope
from hybridkv.engine.ops.cast import cast
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel, scaled
from hybridkv.memory import UnifiedMemory

# transformers builds MLA's latent norms with the RMS norm's default epsilon, not the config's.
LATENT_NORM_EPS = 1e-6


class PagedMLA(nn.Module):
    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        heads = config.num_attention_heads
        mine = tp.split(heads, f"layer {layer_id} MLA query heads")
        self.heads = mine[1] - mine[0]
        self.rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scaling = self.qk_dim**-0.5
        h, bias, q_rank = config.hidden_size, config.attention_bias, config.q_lora_rank
        if q_rank is None:
            self.q_proj = Linear(h, self.heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(h, q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(q_rank, self.heads * self.qk_dim, bias=False)
        self.low_rank_q = q_rank is not None
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, self.heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(self.heads * self.v_dim, h, bias=bias)
        tp.column(self.q_b_proj if self.low_rank_q else self.q_proj, [scaled(mine, self.qk_dim)], heads * self.qk_dim)
        kv_width = self.nope_dim + self.v_dim
        tp.column(self.kv_b_proj, [scaled(mine, kv_width)], heads * kv_width)
        tp.row(self.o_proj, [scaled(mine, self.v_dim)], heads * self.v_dim)

    def memory_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-token shape of the latent this layer reads and writes in its pool."""
        return {"latent": (1, self.rank + self.rope_dim)}

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        return q.view(x.shape[0], self.heads, self.qk_dim)

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory, rope: RopeTables) -> torch.Tensor:
        q = self._query(x)
        q_nope, q_rope = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)
        c_kv, k_rope = torch.split(self.kv_a_proj_with_mqa(x), [self.rank, self.rope_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), apply_rope(k_rope[:, None], rope)[:, 0]], dim=-1)

        weight = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_dim, self.rank)
        w_k, w_v = torch.split(weight, [self.nope_dim, self.v_dim], dim=1)
        query = self._absorbed(q, w_k)
        io = ctx.token_io(self.layer_id)
        span = io.layout.span(self.layer_id, ("latent",))
        at = io.write(span, latent[:, None, None])
        out = ctx.attend(
            io,
            query,  # (T, heads, rank + rope)
            lambda queries, part: self._attend(
                queries,
                cast(part.entries[at][0, :, :, 0], x.dtype),  # (R_p, W, rank + rope)
                cast(part.mask, x.dtype),
            ),
        )[..., : self.rank]  # (T, heads, rank)
        out = torch.einsum("thc,hvc->thv", out, w_v)  # each latent read back through its head's value projection
        return self.o_proj(out.reshape(out.shape[0], self.heads * self.v_dim))

    def _absorbed(self, q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
        """Queries ``(T, heads, qk)`` -> ``(T, heads, rank + rope)`` in the latents' space.

        Absorbed form: ``q_nope . (W_k c) = (W_k^T q_nope) . c`` and ``p @ (W_v c) = W_v (p @ c)``, so the
        context's latents are never expanded per head; one multi-query attention over the latents themselves
        (each latent is its own value: the value's rope part is computed and dropped, for one kernel with
        equal head dims), the value projection applied once to every token's output."""
        q_nope, q_rope = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)
        return torch.cat((torch.einsum("thn,hnc->thc", q_nope, w_k), q_rope), dim=-1)

    def _attend(self, query: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Absorbed queries ``(R', heads, Q', rank + rope)`` over key latents ``(R', W, rank + rope)`` ->
        ``(R', heads, Q', rank + rope)``."""
        keys = latents[:, None]  # one key (and value) head shared by every query head
        return F.scaled_dot_product_attention(
            query, keys, keys, attn_mask=mask, scale=self.scaling, enable_gqa=self.heads > 1
        )
