"""A gated MLP's ``act(gate) * up`` in one pass (``csrc/gated_act.cpp``): GeGLU (tanh GELU) and SwiGLU (SiLU).

When (``fuses_act``): CPU bf16 or fp32 gate and up of one shape (rows, I), the C++ kernels built,
``fast_paths(fused_activations=...)`` on, not inside a graph being traced. It replaces the activation's kernel, the
product and their temporaries (torch's bf16 tanh GELU: ~2.4 ns an element alone on this machine; the kernel reads
gate and up once and writes once).

Numerics: the activation and the product in fp32 (the tanh GELU in its sigmoid form ``g * sigmoid(2 z)``, the same
function), exp within ~1 ulp: fp32 outputs within a few ulp of torch's (as close to the fp64 value as the
engine's sigmoid form and torch's tanh kernel); bf16 outputs rounded once where the torch path rounds the
activation, then the product: within bf16 rounding, and closer to the fp32 product on average.
"""

from __future__ import annotations

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.native import native

KERNEL_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}
"""The activations (their ``transformers`` names) the kernel computes, and its names for them."""


def fuses_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> bool:
    """Whether ``gated_act(gate, up, act)`` runs the kernel for these arguments."""
    return (
        FAST.fused_activations
        and FAST.native_kernels
        and act in KERNEL_ACTS
        and gate.dim() == 2
        and gate.shape == up.shape
        and gate.dtype == up.dtype
        and gate.dtype in (torch.bfloat16, torch.float32)
        and gate.device.type == "cpu"
        and up.device.type == "cpu"
        and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))
        and not torch.compiler.is_compiling()
        and native() is not None
    )


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` (``act`` one of ``KERNEL_ACTS``), each row of ``gate`` and ``up`` read in place (a row
    stride of their own); ``fuses_act`` must hold."""
    kernels = native()
    assert kernels is not None, "fuses_act said the kernels are built"
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    out: torch.Tensor = kernels.gated_act(gate, up, KERNEL_ACTS[act])
    return out
