"""A decode's routed experts in one call (``csrc/moe_decode.cpp``): each token's chosen experts' gated MLPs, weighted
and summed.

Per token and chosen expert: ``gate, up = x @ gate_up[e].T`` (rounded to the dtype), ``inner = act(gate) * up``
(rounded once), ``y = inner @ down[e].T`` (rounded to the dtype); the token's output is the sum of ``weight * y``
over its experts in fp32, rounded once. The routed path (``layers.routing``) computes the same products with a dozen
small torch calls per layer (sort, searchsorted, gather, one call per expert and projection, cat, index_add): at a
decode's one or two tokens those calls, not the arithmetic, were most of the layer. Widened Qwen3-Next (8 experts,
512 -> 256, top-2), bf16, one thread: see ``layers.mlp.SoftmaxTopKMoE``.

When (``moe_decode_takes``): CPU bf16 or fp32 ``x`` of at most ``DECODE_TOKENS`` tokens, expert weights of its dtype
whose rows are contiguous, an activation the kernel computes (``gated_act.KERNEL_ACTS``), the C++ kernels built,
``fast_paths(fused_experts=...)`` on, not inside a graph being traced, no gradient recorded.

Numerics: within the dtype's rounding of the routed path (the activation and the weighted sum rounded once instead
of per step); fp32 within fp32 rounding (another summation order).
"""

from __future__ import annotations

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.gated_act import KERNEL_ACTS
from hybridkv.engine.ops.native import native

DECODE_TOKENS = 4
"""The most tokens a call takes (each token streams its experts' weights: more tokens share experts)."""


def moe_decode_takes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> bool:
    """Whether ``moe_experts(x, ..., gate_up, down, act)`` runs the kernel for these arguments."""
    if torch.compiler.is_compiling():  # first: a traced graph keeps the routed path
        return False
    return (
        FAST.fused_experts
        and FAST.native_kernels
        and act in KERNEL_ACTS
        and x.dim() == 2
        and 0 < x.shape[0] <= DECODE_TOKENS
        and x.dtype in (torch.bfloat16, torch.float32)
        and gate_up.dtype == x.dtype
        and down.dtype == x.dtype
        and gate_up.stride(-1) == 1
        and down.stride(-1) == 1
        and x.is_cpu
        and gate_up.is_cpu
        and down.is_cpu
        and not (torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad or down.requires_grad))
        and native() is not None
    )


def moe_experts(
    x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str
) -> torch.Tensor:
    """``x (T, H)``, each token's experts ``index (T, k)`` and routing ``weights (T, k)`` (x's dtype), experts
    ``gate_up (E, 2I, H)`` (gate rows first) and ``down (E, H, I)`` -> ``(T, H)``: each token's weighted sum of its
    experts' gated MLPs; ``moe_decode_takes`` must hold."""
    kernels = native()
    assert kernels is not None, "moe_decode_takes said the kernels are built"
    out: torch.Tensor = kernels.moe_experts(
        x.contiguous(), index.contiguous(), weights.contiguous(), gate_up, down, KERNEL_ACTS[act]
    )
    return out
