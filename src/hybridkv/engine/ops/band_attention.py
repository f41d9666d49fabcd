"""Attention over a key part whose queries each see a narrow band of its columns (``csrc/band_attention.cpp``): a
sliding-window layer's prefill rows, where ``scaled_dot_product_attention`` over the part computes every (query,
column) pair and masks all but the window away (widened tiny Gemma 3, window 8, 144-token rows: the 4 sliding
layers' SDPA took ~2/3 of the prefill attention; one part of 14 rows x 144 queries x 160 columns, one thread: ~0.4-0.5x
SDPA's time, alternating in one process).

When (``bands``): bf16 CPU queries and keys, no attention sinks, the C++ kernels built,
``fast_paths(band_attention=...)`` on, and the layer's pool keeps a window (``PoolId.max_span``) of at most
``BAND_SHARE`` of the part's key columns. fp32 keeps SDPA (the reference, token-exact against ``transformers``).

Numerics: per query only the columns from its first to its last visible one (the mask's finite entries); scores,
softmax and the weighted sum in fp32, rounded to bf16 once (as ``ops.paged_decode``): within bf16 rounding of the
SDPA path, not bit-equal.
"""

from __future__ import annotations

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.native import native

BAND_SHARE = 0.25
"""The widest window, as a share of a part's key columns, that the kernel takes (a wider band is dense enough for
SDPA's matrix kernels to win)."""


def bands(q: torch.Tensor, keys: torch.Tensor, window: int | None, sinks: bool) -> bool:
    """Whether ``band_attention`` runs for queries ``q`` over ``keys`` ``(R, W, kv_heads, D)`` of a pool that keeps
    ``window`` positions (None: the whole history)."""
    return (
        FAST.band_attention
        and FAST.native_kernels
        and window is not None
        and window <= BAND_SHARE * keys.shape[1]
        and not sinks
        and q.dtype == torch.bfloat16
        and keys.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and native() is not None
    )


def band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries ``(R, heads, Q, D)`` over keys and values ``(R, W, kv_heads, D)`` with the additive fp32 mask
    ``(R, 1, Q, W)`` -> ``(R, heads, Q, D)``; ``bands`` must hold. A query whose mask row is all -inf gets zeros."""
    kernels = native()
    assert kernels is not None, "bands said the kernels are built"
    out: torch.Tensor = kernels.band_attention(q, k, v, mask, scale)
    return out
