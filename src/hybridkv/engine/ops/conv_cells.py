"""Causal conv1d steps on windows where they lie in the state pool, by cell: a decode (``csrc/conv_decode.cpp``) and a
padded batch of chunks (``csrc/conv_prefill.cpp``).

When (``convs_in_pool``): ``fast_paths(state_cells=...)`` and ``native_kernels`` on, the C++ kernels built, a
bf16 or fp32 CPU input, a pool view ``(cells, channels, kernel - 1)`` of its dtype whose windows are contiguous in
each cell, activation SiLU or none, not inside a graph being traced.

Invariants: row ``r``'s window is cell ``cells[r]`` of the pool, moved there by its new inputs (nothing else of the
pool touched); the output is ``ops.conv``'s ``causal_conv1d_decode`` / ``causal_conv1d_prefill``'s with their taps in
fp32 (``fp32_conv``), within fp32 rounding before the one rounding to the input's dtype (the taps' sum in order,
another exp in the SiLU); the new window is theirs exactly.
"""

from __future__ import annotations

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.native import native


def convs_in_pool(x: torch.Tensor, pool: torch.Tensor, activation: str | None) -> bool:
    """Whether the kernels run for inputs ``x`` (``(R, C)`` or ``(R, Q, C)``) and ``pool``."""
    return (
        FAST.state_cells
        and FAST.native_kernels
        and activation in (None, "silu", "swish")
        and x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and pool.dtype == x.dtype
        and pool.device.type == "cpu"
        and pool.dim() == 3
        and pool.stride(2) == 1
        and pool.stride(1) == pool.shape[2]
        and not torch.compiler.is_compiling()
        and native() is not None
    )


def causal_conv1d_decode_cells(
    x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, cells: torch.Tensor, activation: str | None
) -> torch.Tensor:
    """One new token per request, ``x [R, C]``, the depthwise kernel ``weight [C, K]``, the windows ``pool[cells]``
    (updated in the pool) -> out ``[R, C]`` in x's dtype; ``convs_in_pool`` must hold."""
    kernels = native()
    assert kernels is not None, "convs_in_pool said the kernels are built"
    out: torch.Tensor = kernels.conv_decode_cells(
        x.contiguous(), weight.float().contiguous(), pool, cells.contiguous(), activation is not None
    )
    return out


def causal_conv1d_prefill_cells(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    cells: torch.Tensor,
    lengths: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    """A padded batch of chunks ``x [R, Q, C]`` (``lengths [R]`` valid inputs per row) continuing the windows
    ``pool[cells]`` (updated in the pool), the depthwise kernel ``weight [C, K]`` -> out ``[R, Q, C]`` in x's dtype
    (unspecified past each row's length); ``convs_in_pool`` must hold."""
    kernels = native()
    assert kernels is not None, "convs_in_pool said the kernels are built"
    out: torch.Tensor = kernels.conv_prefill_cells(
        x.contiguous(),
        weight.float().contiguous(),
        pool,
        cells.contiguous(),
        lengths.to(torch.int64).contiguous(),
        activation is not None,
    )
    return out
