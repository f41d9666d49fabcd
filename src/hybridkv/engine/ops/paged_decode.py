"""One-token attention read straight from the pool's pages (``csrc/paged_decode.cpp``): a step's decode rows skip the
key gather (``pool_io``) and the padded ``scaled_dot_product_attention`` over it.

When (``pages_decodes``, per token pool and step): a CPU step whose pool keeps bf16 or fp32 K/V (``PagedAttention``
layers, slots named ``k`` and ``v``), no attention sinks, the C++ kernels built, ``fast_paths(paged_decode=...)`` on.
Then ``step.build_step`` plans the decode group as a page table instead of gathered columns; each layer's
``TokenIO.write`` puts the decode rows' new K/V in the pool at once, and the kernel reads each row's visible columns
(the pool's history rule: ``first_needed(seq) <= position < seq``) from their pages.

Numerics: scores, softmax and the weighted sum of values in fp32, rounded to bf16 once (fp32: not rounded); torch's
CPU flash kernel rounds the probabilities to bf16 before the values, and sums in its own order and blocks, so the
outputs agree within the dtype's rounding, not bit for bit (fp32 stays token-exact against ``transformers``: the
engine's fp32 tests run with it on).
The scores' dot products take AVX512-BF16's pair instruction (VDPBF16PS) where the CPU has it, the softmax a
vectorised exp within ~1 fp32 ulp (64 rows x 144 columns, 4 heads over 2 KV heads of 128, one thread: ~1.4x
faster than scalar ``std::exp`` and fp32 dot products, measured A/B in one process; outputs equal but for ~1 in
10^4, one bf16 step apart).
The kernel prefetches a few columns ahead (the pages are scattered over the arena) and sums each 32 outputs' values in
registers over the columns (64 rows x 150 columns from 800 random cells, one thread: ~0.85x the time of the loop
over columns with the sums in memory; bit-equal: the same products summed in the same order).
fp32 entries take the same loops with 16-lane fp32 FMAs for the dots (widened Gemma 3, 64 rows x 144 shared-prefix
columns, one thread: the gather and SDPA it replaces were 17% of the workload's time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.native import native


@dataclass(frozen=True)
class PagedRows:
    """Some rows of a step in one token pool read from its pages: the decode group (the step's first rows and tokens,
    one each) or the rows after it (``ops.paged_spans``); their tokens row after row."""

    table: torch.Tensor  # (R, W) int64: each row's page cells from its first visible page (the sink cell after)
    start: torch.Tensor  # (R,) int64: the row's first visible column (columns count from its first page's slot 0)
    stop: torch.Tensor  # (R,) int64: one past its last new token's column
    cell: torch.Tensor  # (T,) int64: each new token's cell
    offset: torch.Tensor  # (T,) int64: and its slot in that cell's page
    q_begin: torch.Tensor  # (R + 1,) int64: row r's tokens are [q_begin[r], q_begin[r + 1])


def pages_decodes(grid: torch.Tensor, names: set[str], sinks: bool) -> bool:
    """Whether a step reads the decode rows of the token pool ``grid`` (its slots named ``names``) from its pages."""
    return (
        FAST.paged_decode
        and FAST.native_kernels
        and not sinks
        and grid.device.type == "cpu"
        and (grid.dtype == torch.bfloat16 or grid.dtype == torch.float32)
        and names == {"k", "v"}
        and native() is not None
    )


def paged_decode(q: torch.Tensor, grid: torch.Tensor, slots: slice, paged: PagedRows, scale: float) -> torch.Tensor:
    """Queries ``(R, heads, D)`` of the decode rows over the keys and values in ``grid``'s ``slots`` (K, then V) ->
    ``(R, heads, D)``."""
    kernels = native()
    assert kernels is not None, "pages_decodes said the kernels are built"
    out: torch.Tensor = kernels.paged_decode(
        q.contiguous(), grid, slots.start, slots.start + 1, paged.table, paged.start, paged.stop, scale
    )
    return out
