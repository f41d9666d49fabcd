"""Mamba2 mixer (Nemotron-H) over state slots.

Per step: ``in_proj`` -> gate ``z`` | conv input ``x|B|C`` | time step ``dt``; the causal
conv continues each request's conv window; the SSD scan continues its SSM state; a
group-wise RMS norm of ``y * silu(z)``; ``out_proj``. The state lives only in the memory's
state pool: the conv window as one tensor per component, ``conv_x`` / ``conv_B`` / ``conv_C``
``(channels, kernel - 1)`` per request (adjacent in the cell: read as one x|B|C window), and
``ssm_state`` ``(heads, head_dim, ssm_state_size)``; the layer reads and updates them in the
step's gathered state cells (``ctx.state_io``: gathered once per step, zero where a state
starts fresh, written back once).

Tensor parallel (``tp``): the rank holds its heads and its B/C groups (both split evenly):
its rows of ``in_proj`` (its parts of ``z``, ``x``, ``B``, ``C`` and ``dt``), its conv
channels (its own x, B and C channels: three ranges of the full ``x|B|C`` conv), its
entries of ``dt_bias`` / ``A_log`` / ``D`` / the norm (whose groups stay whole) and its
columns of ``out_proj``, so the output is its partial sum.

The step's one-token spans use the one-token ops (transformers' decode path, which does not
clamp ``dt`` to ``time_step_min``) and its longer spans the chunked ops on their padded batch
(its prefill path, which does; ``ctx.groups``). The two differ only where
``softplus(dt + dt_bias) < time_step_min``, exactly as the reference's own two paths do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.forward.step import Group, StepContext
from hybridkv.engine.layers.linear import Linear
from hybridkv.engine.ops import causal_conv1d_decode, causal_conv1d_prefill, ssd_decode, ssd_prefill
from hybridkv.engine.ops.cast import cast, f32
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel, scaled, shifted
from hybridkv.memory import UnifiedMemory


class GroupedGatedRMSNorm(nn.Module):
    """``w * rmsnorm_per_group(x * silu(gate))`` (gate before norm), groups of ``group_size`` channels."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = f32(x) * F.silu(f32(gate))
        grouped = F.rms_norm(h.view(*h.shape[:-1], -1, self.group_size), (self.group_size,), None, self.eps)
        return self.weight * cast(grouped.view(h.shape), x.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        heads, groups = config.mamba_num_heads, config.n_groups
        self.head_dim, self.state_size = config.mamba_head_dim, config.ssm_state_size
        mine = tp.split(heads, f"layer {layer_id} Mamba2 heads")
        my_groups = tp.split(groups, f"layer {layer_id} Mamba2 groups (n_groups)")
        self.heads, self.groups = mine[1] - mine[0], my_groups[1] - my_groups[0]
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        bc_size = self.groups * self.state_size
        self.conv_parts = {"conv_x": self.inner, "conv_B": bc_size, "conv_C": bc_size}
        self.chunk_size = config.chunk_size
        self.dt_limit = (float(config.time_step_min), float("inf"))
        self.activation = config.mamba_hidden_act
        kernel, h = config.conv_kernel, config.hidden_size
        self.in_proj = Linear(h, self.inner + self.conv_dim + self.heads, bias=config.use_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=config.use_conv_bias, padding=kernel - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        full_inner, full_bc = heads * self.head_dim, groups * self.state_size
        self.norm = GroupedGatedRMSNorm(self.inner, full_inner // groups, config.layer_norm_epsilon)
        self.out_proj = Linear(self.inner, h, bias=config.use_bias)
        x_ch, bc = scaled(mine, self.head_dim), scaled(my_groups, self.state_size)
        conv = [x_ch, *shifted([bc], full_inner), *shifted([bc], full_inner + full_bc)]  # x | B | C
        full_conv = full_inner + 2 * full_bc
        in_ranges = [x_ch, *shifted(conv, full_inner), *shifted([mine], full_inner + full_conv)]  # z | x|B|C | dt
        tp.column(self.in_proj, in_ranges, full_inner + full_conv + heads)
        tp.param(self.conv1d, "weight", 0, conv, full_conv)
        if self.conv1d.bias is not None:
            tp.param(self.conv1d, "bias", 0, conv, full_conv)
        for name in ("dt_bias", "A_log", "D"):
            tp.param(self, name, 0, [mine], heads)
        tp.param(self.norm, "weight", 0, [x_ch], full_inner)
        tp.row(self.out_proj, [x_ch], full_inner)

    def memory_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-request shapes of the state this layer reads and writes."""
        window = self.conv1d.weight.shape[-1] - 1
        return {
            **{name: (channels, window) for name, channels in self.conv_parts.items()},
            "ssm_state": (self.heads, self.head_dim, self.state_size),
        }

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory) -> torch.Tensor:
        gate, xbc, dt = torch.split(self.in_proj(x), [self.inner, self.conv_dim, self.heads], dim=-1)
        io = ctx.state_io(self.layer_id)
        windows = io.view(self.layer_id, tuple(self.conv_parts))
        states = io.view(self.layer_id, ("ssm_state",))
        ys = []
        for group in ctx.groups:  # one-token spans apart from longer ones
            window, state = windows[group.rows], states[group.rows]
            out, new_window, new_state = self._mix(xbc, dt, window, state, group)
            window.copy_(new_window)
            if new_state is not state:  # the one-token scan updates the state in place
                state.copy_(new_state)
            ys.append(out)
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        return self.out_proj(cast(self.norm(y, gate), x.dtype))

    def _mix(
        self, xbc: torch.Tensor, dt: torch.Tensor, window: torch.Tensor, state: torch.Tensor, group: Group
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv + SSD scan for one group: ``(y (T', inner) fp32, new window, new state)``."""
        weight, A = self.conv1d.weight.squeeze(1), -torch.exp(f32(self.A_log))
        sizes = [self.inner, self.groups * self.state_size, self.groups * self.state_size]
        if group.decode_only:  # the one-token ops, as transformers uses for a one-token forward
            index = group.tokens
            conv, window = causal_conv1d_decode(xbc[index], window, weight, self.conv1d.bias, self.activation)
            xs, B, C = torch.split(conv, sizes, dim=-1)
            t = conv.shape[0]
            y, state = ssd_decode(
                xs.view(t, self.heads, self.head_dim),
                dt[index],
                A,
                B.view(t, self.groups, self.state_size),
                C.view(t, self.groups, self.state_size),
                self.D,
                self.dt_bias,
                state,
            )
            return y.reshape(t, self.inner), window, state
        conv, window = causal_conv1d_prefill(
            group.pad(xbc), window, weight, self.conv1d.bias, self.activation, group.lengths
        )
        xs, B, C = torch.split(conv, sizes, dim=-1)
        r, q = conv.shape[:2]
        y, state = ssd_prefill(
            xs.reshape(r, q, self.heads, self.head_dim),
            group.pad(dt),
            A,
            B.reshape(r, q, self.groups, self.state_size),
            C.reshape(r, q, self.groups, self.state_size),
            self.D,
            self.dt_bias,
            state,
            self.chunk_size,
            self.dt_limit,
            group.lengths,
        )
        return group.unpad(y).reshape(-1, self.inner), window, state
