"""Paged GQA attention over UnifiedMemory: full or sliding-window, with the variants the served models use.

Per step: project, (q/k norm), RoPE, put the new K/V into the step's gathered context of
this layer's pool (``pool_io``: every layer's context pages were gathered once for the step;
the pool gets the new K/V once, at the end of the step), and attend through
``scaled_dot_product_attention``: queries ``(R, heads, Q, D)`` against keys ``(R, kv_heads,
W, D)`` with the step's additive mask (causal, the pool's window, padding; built once per
step); one-token decodes and longer spans attend as padded groups (``ctx.groups``), each cut
into parts of similar key widths (``KeyPart``). On the CPU in bf16 or fp32 they read the pool's pages instead
(``ops.paged_decode`` for the decodes, ``ops.paged_spans`` for the longer spans: no gathered copy, no mask).

Variants: attention sinks (gpt-oss: one learned logit per head joins the softmax and is
dropped: a spare zero key of each row whose mask entry is the sink), output gate (Qwen3-Next:
``q_proj`` yields query and gate per head, the output is multiplied by ``sigmoid(gate)``),
q/k RMS norms, query scaling.

Tensor parallel (``tp``): the rank holds its query heads and the KV heads
``Parallel.kv_head_range`` gives it (a GQA head replicated on several ranks when TP > KV
heads), its rows of q/k/v and its columns of ``o_proj``; the output is its partial sum.

Invariants: K/V live only in the memory pool (``mem.view(layer_id, "k"/"v")``, the rank's
heads); the visible keys are the pool id's history rule (``first_needed(q + 1) <= k <= q``;
a sliding window: ``q - window < k <= q``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.forward.pool_io import KeyPart
from hybridkv.engine.forward.step import StepContext
from hybridkv.engine.layers.linear import Linear
from hybridkv.engine.layers.norms import RMSNorm, derived, rms_norm_rounded, rounds_norm
from hybridkv.engine.layers.rope import RopeTables, apply_rope
from hybridkv.engine.ops.band_attention import band_attention, bands
from hybridkv.engine.ops.cast import cast, f32
from hybridkv.engine.ops.paged_decode import paged_decode
from hybridkv.engine.ops.paged_spans import paged_spans
from hybridkv.engine.ops.qk_rope import fuses_qk_rope, qk_rope
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel, scaled
from hybridkv.memory import UnifiedMemory


class PagedAttention(nn.Module):
    def __init__(
        self,
        layer_id: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        scaling: float,
        bias: bool = False,
        qk_norm_eps: float | None = None,
        output_gate: bool = False,
        sinks: bool = False,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"layer {layer_id}: {heads} query heads are not a multiple of {kv_heads} KV heads")
        q_heads, kv_range = tp.split(heads, f"layer {layer_id} query heads"), tp.kv_heads(kv_heads)
        self.layer_id, self.head_dim = layer_id, head_dim
        self.heads, self.kv_heads = q_heads[1] - q_heads[0], kv_range[1] - kv_range[0]
        self.scaling, self.output_gate = scaling, output_gate
        q_width = head_dim * (2 if output_gate else 1)  # per head: query (and its gate) side by side
        self.q_proj = Linear(hidden, self.heads * q_width, bias=bias)
        self.k_proj = Linear(hidden, self.kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(self.heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, offset=True) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, offset=True) if qk_norm_eps is not None else None
        self.sinks = nn.Parameter(torch.zeros(self.heads)) if sinks else None
        tp.column(self.q_proj, [scaled(q_heads, q_width)], heads * q_width)
        tp.column(self.k_proj, [scaled(kv_range, head_dim)], kv_heads * head_dim)
        tp.column(self.v_proj, [scaled(kv_range, head_dim)], kv_heads * head_dim)
        tp.row(self.o_proj, [scaled(q_heads, head_dim)], heads * head_dim)
        if sinks:
            tp.param(self, "sinks", 0, [q_heads], heads)

    def memory_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-token shapes this layer reads and writes in its pool."""
        return {"k": (self.kv_heads, self.head_dim), "v": (self.kv_heads, self.head_dim)}

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory, rope: RopeTables) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q = self.q_proj(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(t, self.heads, 2 * d).chunk(2, dim=-1)
            gate = gate.reshape(t, -1)
        q, k = q.view(t, self.heads, d), self.k_proj(x).view(t, self.kv_heads, d)
        v = self.v_proj(x).view(t, self.kv_heads, d)
        qk = self._qk_rope(q, k, rope)
        q, k = qk[:, : self.heads], qk[:, self.heads :]

        io = ctx.token_io(self.layer_id)
        span = io.layout.span(self.layer_id, ("k", "v"))
        at = io.write(span, (k, v))
        window = io.layout.pool_id.max_span
        out = ctx.attend(
            io,
            q,
            lambda queries, part: self._attend(queries, part, at, window),
            lambda queries, paged: paged_decode(queries, io.layout.grid, span, paged, self.scaling),
            lambda queries, rows: paged_spans(queries, io.layout.grid, span, rows, window, self.scaling),
        ).reshape(t, self.heads * d)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _qk_rope(self, q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        """Queries ``(T, heads, D)`` and keys ``(T, kv_heads, D)`` side by side, normed (q/k norms) and rotated: one
        kernel where ``ops.qk_rope.fuses_qk_rope`` holds, else one concatenation, one norm and one rotation for
        both."""
        scale = (
            self._head_scales(self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None else None
        )
        if rope.rotary is not None and rope.cos is not None and rope.sin is not None and fuses_qk_rope(q, k):
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            return qk_rope(q, k, scale, eps, rope.cos, rope.sin, rope.rotary)
        qk = torch.cat((q, k), dim=1)
        if self.q_norm is not None and scale is not None:
            qk = self._qk_norm(qk, scale, self.q_norm.eps)
        return apply_rope(qk, rope)  # queries and keys rotate alike: one rotation for both

    def _head_scales(self, q_norm: RMSNorm, k_norm: RMSNorm) -> torch.Tensor:
        """Each head's norm factor ``(heads + kv_heads, D)``: the query norm's, then the key norm's."""
        return derived(
            self,
            "_qk_scale",
            (q_norm.weight, k_norm.weight),
            lambda _q, _k: torch.cat((q_norm.scale().expand(self.heads, -1), k_norm.scale().expand(self.kv_heads, -1))),
        )

    def _qk_norm(self, qk: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        """Queries' and keys' RMS norms over ``(T, heads + kv_heads, D)`` in one normalisation, each head scaled by
        its own norm's factor (what ``q_norm(q)`` and ``k_norm(k)`` compute, without the second norm's ops)."""
        if rounds_norm(qk):
            return rms_norm_rounded(qk, scale, eps)
        return cast(F.rms_norm(f32(qk), (qk.shape[-1],), None, eps) * scale, qk.dtype)

    def _attend(self, q: torch.Tensor, part: KeyPart, span: slice, window: int | None) -> torch.Tensor:
        """Queries ``(R_p, heads, Q, D)`` over the part's keys and values (``span``: their slots in the part, as
        ``TokenIO.write`` returned them; ``window``: the pool's, None for the whole history) -> ``(R_p, heads, Q,
        D)``."""
        kv = part.entries[span]  # (2, R_p, W, kv, D)
        if bands(q, kv[0], window, self.sinks is not None):
            return band_attention(q, kv[0], kv[1], part.mask, self.scaling)
        mask = part.mask if self.sinks is None else part.with_sinks(self.sinks)
        return F.scaled_dot_product_attention(
            q,
            kv[0].transpose(1, 2),
            kv[1].transpose(1, 2),
            attn_mask=cast(mask, q.dtype),
            scale=self.scaling,
            enable_gqa=self.heads != self.kv_heads,
        )
