"""A GatedDeltaNet decode step on fp32 states where they lie in the state pool, by cell (``csrc/gdn_decode.cpp``).

When (``decodes_in_pool``): ``fast_paths(state_cells=...)`` and ``native_kernels`` on, the C++ kernels built, an fp32
CPU pool view ``(cells, heads_v, dk, dv)`` whose cells' states are contiguous, not inside a graph being traced.

Invariants: row ``r``'s state is cell ``cells[r]`` of the pool, updated there (no gathered copy, nothing else of the
pool touched); the inputs are prepared as ``gated_delta.gated_delta_decode`` prepares them (``decode_inputs``), and
the kernel makes the same products in the same order of operations, its sums in order of ``dk``: the outputs and
states equal that path's within fp32 rounding.
"""

from __future__ import annotations

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.gated_delta import decode_inputs
from hybridkv.engine.ops.native import native


def decodes_in_pool(pool: torch.Tensor) -> bool:
    """Whether ``gated_delta_decode_cells`` runs the kernel on ``pool``, an ``(cells, heads_v, dk, dv)`` view."""
    return (
        FAST.state_cells
        and FAST.native_kernels
        and pool.device.type == "cpu"
        and pool.dtype == torch.float32
        and pool.dim() == 4
        and pool.stride(3) == 1
        and pool.stride(2) == pool.shape[3]
        and pool.stride(1) == pool.shape[2] * pool.shape[3]
        and not torch.compiler.is_compiling()
        and native() is not None
    )


def gated_delta_decode_cells(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    cells: torch.Tensor,
) -> torch.Tensor:
    """One token per request (q, k ``[batch, heads_k, dk]``, v ``[batch, heads_v, dv]``, g, beta ``[batch,
    heads_v]``) on the states ``pool[cells]`` (updated in the pool) -> out ``[batch, heads_v, dv]`` in q's dtype;
    ``decodes_in_pool(pool)`` must hold."""
    kernels = native()
    assert kernels is not None, "decodes_in_pool said the kernels are built"
    out_dtype = q.dtype
    q, k, v, g, beta = (x.contiguous() for x in decode_inputs(q, k, v, g, beta))
    out: torch.Tensor = kernels.gdn_decode_cells(q, k, v, g, beta, pool, cells.contiguous())
    return out.to(out_dtype)
