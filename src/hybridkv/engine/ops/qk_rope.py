"""Queries' and keys' RMS norms and rotary embedding in one pass (``csrc/qk_rope.cpp``) for attention, bf16 or fp32.

When (``fuses_qk_rope``): bf16 or fp32 CPU queries and keys (one dtype), a rotation (not NoPE), the C++ kernels
built, ``fast_paths(fused_rope=...)`` on, not inside a graph being traced. It replaces the queries' and keys'
concatenation, their norm (``norms.rms_norm_rounded`` or torch's ``rms_norm`` over both) and ``rope.apply_rope``'s
rotate-half copy, two products and casts: one read of q and k, one write of the rotated ``(T, H + KV, D)``.

Numerics: the norm as ``ops.rms_norm`` computes it (its mean of squares in fp64), then the rotation in fp32 on the
unrounded norm. bf16: rounded once, where the torch path rounds the norm, ``cos``, ``sin``, ``x * cos``, then the
sum: within a few bf16 steps of it (relative to the rotation's terms), and closer to the fp32 norm-and-rotation.
fp32: within a few ulp of the terms (the engine's fp32 tests stay token-exact against ``transformers``).
"""

from __future__ import annotations

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.native import native


def fuses_qk_rope(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``qk_rope(q, k, ...)`` runs the kernel for these queries and keys (given a rotation)."""
    return (
        FAST.fused_rope
        and FAST.native_kernels
        and q.dtype in (torch.bfloat16, torch.float32)
        and k.dtype == q.dtype
        and q.device.type == "cpu"
        and k.device.type == "cpu"
        and q.dim() == 3
        and k.dim() == 3
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
        and not torch.compiler.is_compiling()
        and native() is not None
    )


def qk_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary: int,
) -> torch.Tensor:
    """``(T, H + KV, D)`` of ``q``'s dtype: the queries ``q`` ``(T, H, D)`` then the keys ``k`` ``(T, KV, D)``, each
    head RMS-normed with its row of ``scale`` ``(H + KV, D)`` fp32 (none: not normed), then rotated by a
    ``rope.RopeTables``' ``cos``, ``sin`` (fp32 ``(T, 1, D)``) over its first ``rotary`` dims; ``fuses_qk_rope``
    must hold."""
    kernels = native()
    assert kernels is not None, "fuses_qk_rope said the kernels are built"
    out: torch.Tensor = kernels.qk_rope(q, k, scale, eps, cos.contiguous(), sin.contiguous(), rotary)
    return out
