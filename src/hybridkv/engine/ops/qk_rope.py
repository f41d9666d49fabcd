"""Queries' and keys' RMS norms and rotary embedding in one pass (``csrc/qk_rope.cpp``) for bf16 attention.

When (``fuses_qk_rope``): bf16 CPU queries and keys, a rotation (not NoPE), the C++ kernels built,
``fast_paths(fused_rope=...)`` on, not inside a graph being traced. It replaces the queries' and keys'
concatenation, their norm (``norms.rms_norm_rounded`` over both) and ``rope.apply_rope``'s rotate-half copy, two
products and casts: one read of q and k, one write of the rotated ``(T, H + KV, D)``.

Numerics: the norm as ``ops.rms_norm`` computes it (its mean of squares in fp64), then the rotation in fp32 on the
unrounded norm, rounded to bf16 once, where the torch path rounds the norm, then ``x * cos``, then the sum: within
bf16 rounding of it, and closer to the fp32 norm-and-rotation.
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
        and q.dtype == torch.bfloat16
        and k.dtype == torch.bfloat16
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
    """``(T, H + KV, D)`` bf16: the queries ``q`` ``(T, H, D)`` then the keys ``k`` ``(T, KV, D)``, each head RMS-normed
    with its row of ``scale`` ``(H + KV, D)`` fp32 (none: not normed), then rotated by a ``rope.RopeTables``'
    ``cos``, ``sin`` (fp32 ``(T, 1, D)``) over its first ``rotary`` dims; ``fuses_qk_rope`` must hold."""
    kernels = native()
    assert kernels is not None, "fuses_qk_rope said the kernels are built"
    out: torch.Tensor = kernels.qk_rope(q, k, scale, eps, cos.contiguous(), sin.contiguous(), rotary)
    return out
