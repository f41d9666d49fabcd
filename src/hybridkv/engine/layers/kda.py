"""Kimi delta attention layer (Kimi-Linear's linear attention) over state slots.

Per step: q, k, v projections -> causal conv (continuing each request's conv window) ->
KDA (continuing its recurrent matrix) with a per-channel forget gate ``g`` and a per-head
``beta``; a sigmoid-gated RMS norm per head; ``o_proj``. The two state tensors live only in
the memory's state pool: the conv window as one tensor per component, ``conv_q`` / ``conv_k`` /
``conv_v`` ``(heads * head_dim, kernel - 1)`` per request (adjacent in the cell: one q|k|v
window), and ``recurrent_state`` ``(heads, head_dim, head_dim)``; the layer reads and updates
them in the step's gathered state cells (``ctx.state_io``: gathered once per step, zero where
a state starts fresh, written back once).

Tensor parallel (``tp``): the rank holds its heads: its rows of q/k/v, ``f_b_proj``,
``b_proj`` and ``g_b_proj``, its entries of ``dt_bias`` / ``A_log``, its own q, k and v
conv channels (three ranges of the full ``q|k|v`` conv) and its columns of ``o_proj``, so
the output is its partial sum; ``f_a_proj`` / ``g_a_proj`` (low rank) are replicated.

The step's one-token spans use the one-token ops (as transformers does for a one-token
forward) and its longer spans the chunked ops on their padded batch (``ctx.groups``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.forward.step import Group, StepContext
from hybridkv.engine.layers.linear import Linear
from hybridkv.engine.ops import causal_conv1d_decode, causal_conv1d_prefill, kda_decode, kda_prefill
from hybridkv.engine.ops.cast import cast, f32
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel, scaled, shifted
from hybridkv.memory import UnifiedMemory

KDA_CHUNK = 8  # measured fastest on the engine's chunks (its per-channel decay tensor grows with the chunk)


class ForgetGate(nn.Module):
    """Per-channel log decay ``-exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)`` ``(T, heads, head_dim)``, fp32."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.f_a_proj = Linear(hidden, head_dim, bias=False)
        self.f_b_proj = Linear(head_dim, heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, heads, 1))  # the checkpoint's shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = (f32(self.f_b_proj(self.f_a_proj(x))) + f32(self.dt_bias)).view(-1, self.heads, self.head_dim)
        # The reference's softplus with an explicit overflow guard (not F.softplus's threshold form).
        g = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        return -torch.exp(f32(self.A_log).view(self.heads, 1)) * g


class SigmoidGatedRMSNorm(nn.Module):
    """``w * rmsnorm(x) * sigmoid(gate)`` over the last dim, in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(f32(x), (x.shape[-1],), f32(self.weight), self.eps)
        return cast(h * torch.sigmoid(f32(gate)), x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        heads, self.head_dim = config.linear_num_heads, config.linear_head_dim
        mine = tp.split(heads, f"layer {layer_id} KDA heads")
        self.heads = mine[1] - mine[0]
        self.size = self.heads * self.head_dim
        kernel, h = config.linear_conv_kernel_dim, config.hidden_size
        self.activation = config.hidden_act
        self.q_proj = Linear(h, self.size, bias=False)
        self.k_proj = Linear(h, self.size, bias=False)
        self.v_proj = Linear(h, self.size, bias=False)
        self.conv_parts = {"conv_q": self.size, "conv_k": self.size, "conv_v": self.size}
        conv_dim = 3 * self.size
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False, padding=kernel - 1)
        self.forget_gate = ForgetGate(h, self.heads, self.head_dim)
        self.b_proj = Linear(h, self.heads, bias=False)
        self.g_a_proj = Linear(h, self.head_dim, bias=False)
        self.g_b_proj = Linear(self.head_dim, self.size, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = Linear(self.size, h, bias=False)
        full, ch = heads * self.head_dim, scaled(mine, self.head_dim)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.forget_gate.f_b_proj, self.g_b_proj):
            tp.column(proj, [ch], full)
        tp.column(self.b_proj, [mine], heads)
        tp.param(self.conv1d, "weight", 0, [ch, *shifted([ch], full), *shifted([ch], 2 * full)], 3 * full)
        tp.param(self.forget_gate, "dt_bias", 0, [ch], full)
        tp.param(self.forget_gate, "A_log", 2, [mine], heads)
        tp.row(self.o_proj, [ch], full)

    def memory_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-request shapes of the state this layer reads and writes."""
        window = self.conv1d.weight.shape[-1] - 1
        return {
            **{name: (channels, window) for name, channels in self.conv_parts.items()},
            "recurrent_state": (self.heads, self.head_dim, self.head_dim),
        }

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory) -> torch.Tensor:
        t = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x))
        io = ctx.state_io(self.layer_id)
        windows = io.view(self.layer_id, tuple(self.conv_parts))
        states = io.view(self.layer_id, ("recurrent_state",))
        outs = []
        for group in ctx.groups:  # one-token spans apart from longer ones
            window, state = windows[group.rows], states[group.rows]
            part, new_window, new_state = self._mix(mixed, g, beta, window, state, group)
            window.copy_(new_window)
            if new_state is not state:  # a decode updates its state in place
                state.copy_(new_state)
            outs.append(part)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, self.heads, self.head_dim)
        return self.o_proj(self.o_norm(out, gate).reshape(t, self.size))

    def _mix(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        window: torch.Tensor,
        state: torch.Tensor,
        group: Group,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv + KDA for one group: ``(out (T', heads, head_dim), new window, new state)``."""
        heads, dim, weight = self.heads, self.head_dim, self.conv1d.weight.squeeze(1)
        if group.decode_only:  # the one-token ops, as transformers uses for a one-token forward
            index = group.tokens
            conv, window = causal_conv1d_decode(mixed[index], window, weight, None, self.activation)
            t = conv.shape[0]
            q, k, v = (part.view(t, heads, dim) for part in torch.split(conv, self.size, dim=-1))
            out, state = kda_decode(q, k, v, g[index], beta[index], state, in_place=FAST.in_place_states)
            return out, window, state
        conv, window = causal_conv1d_prefill(group.pad(mixed), window, weight, None, self.activation, group.lengths)
        r, nq = conv.shape[:2]
        q, k, v = (part.reshape(r, nq, heads, dim) for part in torch.split(conv, self.size, dim=-1))
        # Short chunks: the intra-chunk decay tensor is (chunk x chunk x head_dim) per chunk and every span is
        # padded to a whole chunk, so the engine's short spans cost far less than at 64 (same result within
        # fp32 rounding: the chunk-split invariance tests of the op).
        out, state = kda_prefill(q, k, v, group.pad(g), group.pad(beta), state, group.lengths, chunk_size=KDA_CHUNK)
        return group.unpad(out), window, state
