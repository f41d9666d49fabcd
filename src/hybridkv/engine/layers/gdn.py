"""GatedDeltaNet (Qwen3-Next linear attention) over state slots.

Per step: project to q, k, v, z (output gate), b (beta) and a (decay); run the causal conv
over q|k|v continuing each request's conv window; run the gated delta rule continuing its
recurrent matrix; gated RMS norm with z; project out. The state lives only in the memory's
state pool: the conv window as one tensor per component, ``conv_q`` / ``conv_k`` / ``conv_v``
``(channels, kernel - 1)`` per request (adjacent in the cell: read as one q|k|v window), and
``recurrent_state`` ``(v_heads, k_dim, v_dim)``; the layer reads and updates them in the
step's gathered state cells (``ctx.state_io``: gathered once per step, zero where a state
starts fresh, written back once), or, with ``fast_paths(state_cells=...)``, where they lie in the
pool by cell (a decode updates both there, ``ops.conv_cells`` and ``ops.gdn_cells``; a prefill
group's conv reads and moves its windows there, ``ops.conv_cells``, and its states are gathered and
written back alone).

Tensor parallel (``tp``): the rank holds whole key heads (and the value heads that go with
them): the projections are grouped per key head, so its rows are contiguous; its conv
channels are its own q, k and v channels (three ranges of the full ``q|k|v`` conv; each is a
contiguous slice of its component's state tensor, which is why the window is stored per
component); its columns of
``out_proj``, so the output is its partial sum.

The step's one-token decodes use the one-token ops (as ``transformers`` does for a one-token
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
from hybridkv.engine.layers.norms import GatedRMSNorm
from hybridkv.engine.ops import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    gated_delta_decode,
    gated_delta_prefill,
)
from hybridkv.engine.ops.cast import f32
from hybridkv.engine.ops.conv_cells import (
    causal_conv1d_decode_cells,
    causal_conv1d_prefill_cells,
    convs_in_pool,
)
from hybridkv.engine.ops.gdn_cells import decodes_in_pool, gated_delta_decode_cells
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel, scaled, shifted
from hybridkv.memory import UnifiedMemory

# Half the reference's 64: the intra-chunk matrices are (chunk x chunk) per chunk and spans are padded to whole
# chunks; measured about twice as fast on the engine's spans (same result within fp32 rounding: the op's
# chunk-split invariance tests).
GDN_CHUNK = 32


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        per = v_heads // k_heads
        mine = tp.split(k_heads, f"layer {layer_id} GatedDeltaNet key heads")
        v_mine = scaled(mine, per)
        self.k_heads, self.v_heads = mine[1] - mine[0], per * (mine[1] - mine[0])
        self.key_size, self.value_size = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_parts = {"conv_q": self.key_size, "conv_k": self.key_size, "conv_v": self.value_size}
        conv_dim = 2 * self.key_size + self.value_size
        kernel = config.linear_conv_kernel_dim
        self.activation = config.hidden_act
        h = config.hidden_size
        self.in_proj_qkvz = Linear(h, 2 * self.key_size + 2 * self.value_size, bias=False)
        self.in_proj_ba = Linear(h, 2 * self.v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False, padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_size, h, bias=False)
        full_key, full_value = k_heads * self.k_dim, v_heads * self.v_dim
        block = 2 * self.k_dim + 2 * per * self.v_dim  # one key head's q|k|v|z rows
        tp.column(self.in_proj_qkvz, [scaled(mine, block)], k_heads * block)
        tp.column(self.in_proj_ba, [scaled(mine, 2 * per)], k_heads * 2 * per)
        q_ch, v_ch = scaled(mine, self.k_dim), scaled(v_mine, self.v_dim)
        conv_ranges = [q_ch, *shifted([q_ch], full_key), *shifted([v_ch], 2 * full_key)]
        tp.param(self.conv1d, "weight", 0, conv_ranges, 2 * full_key + full_value)
        tp.param(self, "dt_bias", 0, [v_mine], v_heads)
        tp.param(self, "A_log", 0, [v_mine], v_heads)
        tp.row(self.out_proj, [v_ch], full_value)

    def memory_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-request shapes of the state this layer reads and writes."""
        window = self.conv1d.weight.shape[-1] - 1
        return {
            **{name: (channels, window) for name, channels in self.conv_parts.items()},
            "recurrent_state": (self.v_heads, self.k_dim, self.v_dim),
        }

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections grouped per key head (the checkpoint layout) -> q|k|v (flat), z, b, a."""
        t, per = x.shape[0], self.v_heads // self.k_heads
        qkvz = self.in_proj_qkvz(x).view(t, self.k_heads, 2 * self.k_dim + 2 * per * self.v_dim)
        q, k, v, z = torch.split(qkvz, [self.k_dim, self.k_dim, per * self.v_dim, per * self.v_dim], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, self.k_heads, 2 * per), [per, per], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        # z stays a view (its norm reads it in place): (t, key heads, value heads per key head, v_dim)
        return mixed, z.view(t, self.k_heads, per, self.v_dim), b.reshape(t, self.v_heads), a.reshape(t, self.v_heads)

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory) -> torch.Tensor:
        mixed, z, b, a = self._split(x)
        beta = b.sigmoid()
        g = -f32(self.A_log).exp() * F.softplus(f32(a) + self.dt_bias)
        io = ctx.state_io(self.layer_id)
        conv, recurrent = tuple(self.conv_parts), ("recurrent_state",)
        outs = []
        if FAST.state_cells:  # the windows and states read and updated where they lie in the pool, by cell
            windows, states = io.pool_view(self.layer_id, conv), io.pool_view(self.layer_id, recurrent)
            for group in ctx.groups:
                outs.append(self._in_pool(mixed, g, beta, windows, states, io.cells[group.rows], group))
        else:  # in the step's gathered cells
            windows, states = io.view(self.layer_id, conv), io.view(self.layer_id, recurrent)
            for group in ctx.groups:  # one-token decodes apart from longer spans
                window, state = windows[group.rows], states[group.rows]
                mix = self._decode if group.decode_only else self._prefill
                out, new_window, new_state = mix(mixed, g, beta, window, state, group)
                window.copy_(new_window)
                if new_state is not state:  # a decode updates its state in place
                    state.copy_(new_state)
                outs.append(out)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.out_proj(self.norm(out, z).reshape(x.shape[0], -1))

    def _in_pool(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        windows: torch.Tensor,
        states: torch.Tensor,
        cells: torch.Tensor,
        group: Group,
    ) -> torch.Tensor:
        """A group whose conv windows ``windows[cells]`` and states ``states[cells]`` (views of the pool) are read and
        updated there: its out ``(T', v_heads, v_dim)``. Decodes run the in-pool kernels, a longer group's conv the
        in-pool one (its states gathered and written back); where the kernels cannot run, the group's windows and
        states are gathered and written back."""
        index, weight = group.tokens, self.conv1d.weight.squeeze(1)
        kernels = convs_in_pool(mixed, windows, self.activation)
        if group.decode_only and kernels and decodes_in_pool(states):
            q, k, v = self._heads(causal_conv1d_decode_cells(mixed[index], weight, windows, cells, self.activation))
            return gated_delta_decode_cells(q, k, v, g[index], beta[index], states, cells)
        state = states.index_select(0, cells)
        if not group.decode_only and kernels:
            conv = causal_conv1d_prefill_cells(group.pad(mixed), weight, windows, cells, group.lengths, self.activation)
            out, new_state = self._delta_prefill(conv, g, beta, state, group)
        else:
            mix = self._decode if group.decode_only else self._prefill
            out, new_window, new_state = mix(mixed, g, beta, windows.index_select(0, cells), state, group)
            windows.index_copy_(0, cells, new_window)
        states.index_copy_(0, cells, new_state)
        return out

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One-token conv outputs ``(T', q|k|v)`` -> q, k ``(T', k_heads, k_dim)``, v ``(T', v_heads, v_dim)``."""
        q, k, v = torch.split(conv, [self.key_size, self.key_size, self.value_size], dim=-1)
        t = conv.shape[0]
        return (
            q.view(t, self.k_heads, self.k_dim),
            k.view(t, self.k_heads, self.k_dim),
            v.view(t, self.v_heads, self.v_dim),
        )

    def _decode(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        window: torch.Tensor,
        state: torch.Tensor,
        group: Group,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode group, the one-token ops (as transformers uses for a one-token forward): ``(out (T', v_heads,
        v_dim), new window, new state)``."""
        index = group.tokens
        weight = self.conv1d.weight.squeeze(1)
        conv, window = causal_conv1d_decode(mixed[index], window, weight, None, self.activation)
        q, k, v = self._heads(conv)
        out, state = gated_delta_decode(q, k, v, g[index], beta[index], state, in_place=FAST.in_place_states)
        return out, window, state

    def _prefill(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        window: torch.Tensor,
        state: torch.Tensor,
        group: Group,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A group of longer spans, the chunked ops on its padded batch: ``(out (T', v_heads, v_dim), new window, new
        state)``."""
        weight = self.conv1d.weight.squeeze(1)
        conv, window = causal_conv1d_prefill(group.pad(mixed), window, weight, None, self.activation, group.lengths)
        out, state = self._delta_prefill(conv, g, beta, state, group)
        return out, window, state

    def _delta_prefill(
        self, conv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, group: Group
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunked gated delta rule over a group's padded conv outputs ``(R', Q', q|k|v)``: ``(out (T', v_heads,
        v_dim), new state)``."""
        q, k, v = torch.split(conv, [self.key_size, self.key_size, self.value_size], dim=-1)
        r, nq = conv.shape[:2]
        out, state = gated_delta_prefill(
            q.reshape(r, nq, self.k_heads, self.k_dim),
            k.reshape(r, nq, self.k_heads, self.k_dim),
            v.reshape(r, nq, self.v_heads, self.v_dim),
            group.pad(g),
            group.pad(beta),
            state,
            group.lengths,
            chunk_size=GDN_CHUNK,
        )
        return group.unpad(out), state
