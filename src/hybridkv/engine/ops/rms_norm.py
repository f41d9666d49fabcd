"""An RMS norm (bf16 or fp32) in one pass per row (``csrc/rms_norm.cpp``), the residual add after it fused in; and the
gated norm of GatedDeltaNet's output in one pass per row.

When (``fuses_norm``): a bf16 or fp32 CPU input with an fp32 scale, the C++ kernels built,
``fast_paths(fused_norms=...)`` on, not inside a graph being traced. It replaces ``norms.rms_norm_rounded``'s five
ops and their fp32 temporaries in bf16, torch's ``rms_norm`` composite in fp32 (and, with a residual, the add after
it: ``residual + norm(x)``).

Numerics: the same ops as torch's composite in its order, except the mean of squares, summed in fp64 (the
correctly rounded fp32 mean, where torch's fp32 sum can be off in its last bit): bf16 outputs equal the torch
path's but for a few in a million one bf16 step apart, each at least as close to the fp32 norm; fp32 outputs within
an ulp or two of it (the engine's fp32 tests stay token-exact against ``transformers``). The residual add is
torch's add of the rounded norm, bit for bit.

The gated norm (``fuses_gated_norm``, the same conditions with the weight and gate of ``x``'s dtype, the gate's rows
contiguous) replaces ``norms.GatedRMSNorm``'s dozen ops and fp32 temporaries, and the copy its gate's reshape made of
the projection it is a view of (widened Qwen3-Next bf16, a 2048-token step's six: ~20 ms). Its numbers are the torch
path's roundings in its order (norm, cast, weight, fp32 SiLU gate, cast) with the mean of squares above and the SiLU's
exp within about an ulp: within the dtype's rounding.
"""

from __future__ import annotations

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.native import native


def fuses_norm(x: torch.Tensor, scale: torch.Tensor | None, residual: torch.Tensor | None = None) -> bool:
    """Whether ``rms_norm_fused(x, scale, eps, residual)`` runs the kernel for these arguments."""
    return (
        FAST.fused_norms
        and FAST.native_kernels
        and x.dtype in (torch.bfloat16, torch.float32)
        and x.is_cpu  # per norm and step: ~60 ns, where ``device.type`` makes a device object (~300 ns)
        and scale is not None
        and scale.dtype == torch.float32
        and scale.is_cpu
        and x.shape[-1] > 0
        and scale.numel() % x.shape[-1] == 0
        and (x.numel() // x.shape[-1]) % max(1, scale.numel() // x.shape[-1]) == 0
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
        and not (torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad))
        and not torch.compiler.is_compiling()
        and native() is not None
    )


def rms_norm_fused(
    x: torch.Tensor, scale: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``x / rms(x) * scale`` over ``x``'s last dim (``scale`` ``(blocks, D)``: row ``r`` takes block ``r %
    blocks``) in ``x``'s dtype, plus ``residual`` when given; ``fuses_norm`` must hold."""
    kernels = native()
    assert kernels is not None, "fuses_norm said the kernels are built"
    out: torch.Tensor = kernels.rms_norm(
        x.contiguous(), scale.contiguous(), eps, None if residual is None else residual.contiguous()
    )
    return out


def fuses_gated_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether ``gated_rms_norm_fused(x, weight, gate, eps)`` runs the kernel for these arguments."""
    return (
        FAST.fused_norms
        and FAST.native_kernels
        and x.dtype in (torch.bfloat16, torch.float32)
        and weight.dtype == x.dtype
        and gate.dtype == x.dtype
        and x.is_cpu
        and weight.is_cpu
        and gate.is_cpu
        and x.dim() >= 1
        and 1 <= gate.dim() <= 4
        and x.shape[-1] > 0
        and weight.shape == x.shape[-1:]
        and gate.shape[-1] == x.shape[-1]
        and gate.numel() == x.numel()
        and gate.stride(-1) == 1
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or gate.requires_grad))
        and not torch.compiler.is_compiling()
        and native() is not None
    )


def gated_rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * norm(x) * silu(gate)`` over ``x``'s last dim in ``x``'s dtype; ``gate`` holds ``x``'s rows in order,
    each contiguous (e.g. a ``(T, A, B, D)`` view for ``x`` ``(T, A * B, D)``); ``fuses_gated_norm`` must hold."""
    kernels = native()
    assert kernels is not None, "fuses_gated_norm said the kernels are built"
    gate4 = gate[(None,) * (4 - gate.dim())]  # leading ones: the row order is unchanged
    out: torch.Tensor = kernels.gated_rms_norm(x.contiguous(), weight.contiguous(), gate4, eps)
    return out
