"""Attention of a step's multi-token rows read straight from the pool's pages (``csrc/paged_spans.cpp``): prefill
chunks and prompt tails on a cached prefix skip the key gather (``pool_io``), the padding of their group and the
masked ``scaled_dot_product_attention`` over it, as the decode rows do (``ops.paged_decode``).

When (``pages_spans``, per token pool and step): where ``pages_decodes`` holds (a CPU pool of bf16 or fp32 K/V, no
attention sinks, the C++ kernels built) and ``fast_paths(paged_spans=...)`` is on. Then ``step.build_step`` plans the
rows after the decodes as page tables (one ``PagedRows`` for all of them, whatever their groups), each layer's
``TokenIO.write`` puts their new K/V in the pool at once, and the kernel reads each query's visible columns (the
pool's history rule: a window pool's ``first_needed``) from their pages: the pool gathers nothing that step.

Cost, one thread, this Zen 5, 4 query heads over 2 KV heads of 128, 16-token pages, against the index_select gather
and the masked SDPA it replaces (both fp32; bf16 alike): 64 rows of 16 tokens on a shared 128-token prefix 4.1-4.3 ->
2.6-3.2 ms; 16 fresh rows of 128 tokens 5.9 -> 3.5 ms; one 2048-token chunk 83 -> 21 ms; 4 rows of 512 on 1024 cached
66 -> 27 ms. The scores are laid out as columns x queries so that each key entry is broadcast over 32 queries' lanes
(keys transposed per block instead cost as much as the products on the shared-prefix rows; the queries are transposed
once per task).

Numerics: scores, an online softmax (running max and sum over blocks of 32 columns) and the weighted sum of values
in fp32, rounded to the entries' type once; the same values as SDPA within the dtype's rounding, not bit-equal (fp32
stays token-exact against ``transformers``: the engine's fp32 tests run with it on).
"""

from __future__ import annotations

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.native import native
from hybridkv.engine.ops.paged_decode import PagedRows, pages_decodes
from hybridkv.spec import PoolId, WindowPool


def pages_spans(grid: torch.Tensor, names: set[str], sinks: bool, pool_id: PoolId) -> bool:
    """Whether a step reads the multi-token rows of the token pool ``grid`` (its slots named ``names``, its history
    rule ``pool_id``'s) from its pages. The kernel knows two rules: the whole history, and a window (``WindowPool``:
    each query sees its last ``max_span`` positions); a pool of any other rule keeps its gathered rows (their masks
    follow ``first_needed`` itself). So does a bf16 window pool while ``ops.band_attention`` is on: that kernel reads
    only each query's window, where this one walks blocks of 32 columns."""
    if pool_id.releases_history and not isinstance(pool_id, WindowPool):
        return False
    banded = pool_id.releases_history and grid.dtype == torch.bfloat16 and FAST.band_attention
    return FAST.paged_spans and not banded and pages_decodes(grid, names, sinks)


def paged_spans(
    q: torch.Tensor, grid: torch.Tensor, slots: slice, rows: PagedRows, window: int | None, scale: float
) -> torch.Tensor:
    """Queries ``(T, heads, D)`` of the rows' tokens (row after row) over the keys and values in ``grid``'s ``slots``
    (K, then V); ``window``: the pool's (``PoolId.max_span``), None for the whole history -> ``(T, heads, D)``."""
    kernels = native()
    assert kernels is not None, "pages_spans said the kernels are built"
    out: torch.Tensor = kernels.paged_spans(
        q.contiguous(),
        grid,
        slots.start,
        slots.start + 1,
        rows.table,
        rows.start,
        rows.stop,
        rows.q_begin,
        window or 0,
        scale,
    )
    return out
