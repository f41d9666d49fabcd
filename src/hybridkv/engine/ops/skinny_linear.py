"""``x @ weight.T (+ bias)`` for one to four rows of ``x`` (``csrc/skinny_linear.cpp``): a decode step's projections,
routed experts and logits.

At a few rows a projection reads its weight once and does almost no arithmetic: the cost is the weight's stream from
memory plus the matmul library's fixed cost per call, which dominates small shapes (oneDNN's packed bf16 call ~17 µs
for an 8 x 512 router, MKL's fp32 sgemv alike). The kernel streams the weight rows with a prefetch ahead and keeps
each x row's dot products in registers. One thread, an AMX Xeon (AMX-BF16), weights cycled through 40 copies (out
of cache, as in a step), oneDNN packed -> kernel, one row: bf16 512 -> 512 41 -> 22 µs, 512 -> 8 17 -> 1.8 µs,
512 -> 1536 102 -> 69 µs, 512 -> 32000 (logits) 1.98 -> 1.57 ms; fp32 (MKL) 512 -> 2048 189 -> 157 µs, 512 -> 32000
4.2 -> 3.3 ms. From about four bf16 rows oneDNN's blocked kernels catch up on the larger shapes (hence
``SKINNY_ROWS``).

When (``skinny_takes``): CPU ``x`` of 1 to ``SKINNY_ROWS[dtype]`` rows, bf16 or fp32, weight and bias of its dtype,
each weight row contiguous, the C++ kernels built, ``fast_paths(skinny_linears=...)`` on, not inside a graph being
traced, no gradient recorded.

Numerics: products summed in fp32 (bf16 products are exact in fp32), the bias added in fp32, rounded once to the
dtype: within the dtype's rounding of the matmul libraries' results (another summation order), not bit-equal.
"""

from __future__ import annotations

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.native import native

SKINNY_ROWS = {torch.bfloat16: 2, torch.float32: 4}
"""The most rows of ``x`` the kernel takes, per dtype (above, the packed oneDNN or MKL path is as fast or faster)."""


def skinny_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``skinny_linear(x, weight, bias)`` runs the kernel for these arguments."""
    if torch.compiler.is_compiling():  # first: a traced graph keeps the library's linear
        return False
    most = SKINNY_ROWS.get(x.dtype, 0)
    return (
        FAST.skinny_linears
        and FAST.native_kernels
        and x.numel() <= most * x.shape[-1]
        and x.numel() > 0
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and (bias is None or bias.dtype == x.dtype)
        and x.is_cpu
        and weight.is_cpu
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and native() is not None
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x (..., K)`` of a few rows; ``skinny_takes`` must hold."""
    kernels = native()
    assert kernels is not None, "skinny_takes said the kernels are built"
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out: torch.Tensor = kernels.skinny_linear(rows, weight, bias if bias is None else bias.contiguous())
    return out.view(*x.shape[:-1], weight.shape[0])
