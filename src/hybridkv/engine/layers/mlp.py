"""Feed-forward blocks: a gated MLP, and mixture-of-experts with top-k routers.

MoE experts are routed (``routing.Routing``): each token runs through its top-k experts only,
grouped by expert into one ``grouped_mm`` per projection, with no per-expert Python loop and
no host sync.

Tensor parallel (``tp``): every MLP and expert keeps its columns of the intermediate size
(rows of gate/up, columns of down); routers and the shared-expert gate are replicated; the
output is the rank's partial sum (down-projection biases on rank 0 only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.layers.dense_moe import dense_experts, dense_takes
from hybridkv.engine.layers.linear import Linear, expert_weights
from hybridkv.engine.layers.routing import Routing
from hybridkv.engine.ops.cast import cast
from hybridkv.engine.ops.gated_act import fuses_act, gated_act
from hybridkv.engine.ops.moe_decode import moe_decode_takes, moe_experts
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel, shifted

GELU_TANH_SPLIT = 4096
"""Elements from which a CPU tensor takes ``gelu_tanh``'s sigmoid form (below, one kernel costs less than three)."""


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh``: ``0.5 x (1 + tanh(z))``, ``z = sqrt(2 / pi) (x + 0.044715 x^3)``, on a
    large CPU tensor as ``x sigmoid(2 z)`` (the same function): torch's CPU tanh-GELU kernel takes about 4 ns an
    element on this machine's AVX2, the sigmoid form about half (1024 x 128: 523 -> 280 µs; 64 x 128: 31 -> 22 µs;
    within 5e-7 of it). fp32 only: in bf16 or fp16 each of the form's steps would round (2-4% off where the kernel,
    computing in fp32 and rounding once, is within its dtype's precision)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.numel() < GELU_TANH_SPLIT:
        return F.gelu(x, approximate="tanh")
    z = torch.addcmul(x, x * x, x, value=0.044715)
    return x * torch.sigmoid_(z.mul_(1.5957691216057308))  # 2 sqrt(2 / pi)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu": F.gelu,
    "relu2": lambda x: torch.square(F.relu(x)),
}


def gated(gate: torch.Tensor, up: torch.Tensor, name: str, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``act(gate) * up`` (``act`` the activation ``name``), in one fused pass where ``ops.gated_act.fuses_act``
    holds."""
    return gated_act(gate, up, name) if fuses_act(gate, up, name) else act(gate) * up


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; known: {sorted(ACTIVATIONS)}") from None


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``act(gate) * up`` in one fused pass where ``ops.gated_act.fuses_act``
    holds."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        mine = tp.split(intermediate, "MLP intermediate size")
        local = mine[1] - mine[0]
        self.gate_proj = Linear(hidden, local, bias=bias)
        self.up_proj = Linear(hidden, local, bias=bias)
        self.down_proj = Linear(local, hidden, bias=bias)
        self.act, self.act_name = activation(act), act
        tp.column(self.gate_proj, [mine], intermediate)
        tp.column(self.up_proj, [mine], intermediate)
        tp.row(self.down_proj, [mine], intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_proj(x), self.up_proj(x), self.act_name, self.act))


class SoftmaxTopKMoE(nn.Module):
    """Qwen3-Next's sparse block: softmax router, top-k (renormalised), plus a sigmoid-gated shared expert.

    Experts: ``gate_up_proj`` ``(E, 2I, H)`` (gate rows first), ``down_proj`` ``(E, H, I)``.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        norm_topk: bool,
        act: str,
        shared: int,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        mine = tp.split(intermediate, "MoE expert intermediate size")
        local = mine[1] - mine[0]
        self.gate = Linear(hidden, num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, local))
        tp.param(self, "gate_up_proj", 1, [mine, *shifted([mine], intermediate)], 2 * intermediate)
        tp.param(self, "down_proj", 2, [mine], intermediate)
        self.shared_expert = GatedMLP(hidden, shared, act, tp=tp)
        self.shared_expert_gate = Linear(hidden, 1, bias=False)
        self.top_k, self.norm_topk, self.num_experts = top_k, norm_topk, num_experts
        self.act, self.act_name = activation(act), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self._routed(x, index, cast(top, x.dtype)) + shared

    def _routed(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's weighted sum over its experts ``index (T, k)``: one call for a decode, densely for a few
        tokens, else routed (expert by expert on packed weights)."""
        if moe_decode_takes(x, self.gate_up_proj, self.down_proj, self.act_name):
            return moe_experts(x, index, weights, self.gate_up_proj, self.down_proj, self.act_name)
        if dense_takes(x, self.gate_up_proj, self.top_k):  # every expert on every token, two matmuls
            return dense_experts(x, index, weights, self.gate_up_proj, self.down_proj, self.act, self)
        route = Routing.of(index, weights, self.num_experts)
        rows = route.gather(x)
        packed = expert_weights(rows, self.gate_up_proj, self, "_packed_gate_up")
        packed_down = expert_weights(rows, self.down_proj, self, "_packed_down")
        if packed is not None and packed_down is not None:  # no tensor of every pair's outputs
            return route.packed_mlp(rows, packed, packed_down, self._gated, x.shape[0])
        inner = self._gated(route.matmul(rows, self.gate_up_proj.transpose(1, 2), packed=packed))
        return route.combine(route.matmul(inner, self.down_proj.transpose(1, 2), packed=packed_down), x.shape[0])

    def _gated(self, both: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the experts' joined gate-up outputs ``(N, 2I)`` (gate first)."""
        gate, up = both.chunk(2, dim=-1)
        return gated(gate, up, self.act_name, self.act)


class GptOssMoE(nn.Module):
    """gpt-oss: biased router, softmax over the top-k logits, clamped SwiGLU experts with biases.

    Experts: ``gate_up_proj`` ``(E, H, 2I)`` with gate/up interleaved on the last dim, ``down_proj`` ``(E, I, H)``.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        alpha: float,
        limit: float,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        mine = tp.split(intermediate, "MoE expert intermediate size")
        local = mine[1] - mine[0]
        self.router = Linear(hidden, num_experts, bias=True)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * local))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * local))
        self.down_proj = nn.Parameter(torch.empty(num_experts, local, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        pairs = (2 * mine[0], 2 * mine[1])  # gate and up interleaved: column pairs stay together
        tp.param(self, "gate_up_proj", 2, [pairs], 2 * intermediate)
        tp.param(self, "gate_up_proj_bias", 1, [pairs], 2 * intermediate)
        tp.param(self, "down_proj", 1, [mine], intermediate)
        tp.zeros_off_rank0(self, "down_proj_bias")
        self.top_k, self.num_experts, self.alpha, self.limit = top_k, num_experts, alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, index = torch.topk(self.router(x), self.top_k, dim=-1)
        route = Routing.of(index, F.softmax(top, dim=1, dtype=top.dtype), self.num_experts)
        rows = route.gather(x)
        packed = expert_weights(rows, self.gate_up_proj.transpose(1, 2), self, "_packed_gate_up")
        gate_up = route.matmul(rows, self.gate_up_proj, self.gate_up_proj_bias, packed=packed)
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        packed = expert_weights(glu, self.down_proj.transpose(1, 2), self, "_packed_down")
        return route.combine(route.matmul(glu, self.down_proj, self.down_proj_bias, packed=packed), x.shape[0])
