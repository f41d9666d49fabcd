"""Routed experts of a few tokens computed densely: every expert on every token, in two packed matmuls.

A decode step routes each of its few tokens to ``k`` of ``E`` experts; run per expert (``routing.Routing``) that is
two oneDNN calls per expert chosen, each on a handful of rows, where the call, not the arithmetic, is the cost. Here
all experts' ``gate_up`` weights are one ``(E * 2I, H)`` matrix and all ``down`` weights one ``(H, E * I)`` matrix:
``x`` times the first gives every expert's gate and up for every token; each token's inner activations are scaled
by its routing weight (zero for the experts it did not choose) and the second matmul sums ``weight * down(inner)``
over the experts inside its fp32 accumulation. Widened Qwen3-Next (8 experts, 512 -> 256), one thread, AMX-BF16:
16 tokens 898 -> 503 µs a layer, 64 tokens 1003 -> 788 µs, 256 tokens 1597 -> 2317 µs (hence ``DENSE_PAIRS``); top-2,
1 token 287 -> 543 µs and 2 tokens 472 -> 563 µs (the dense path reads every expert's weights: hence ``tokens * k >=
experts``), 4 tokens 730 -> 558 µs.

Invariants: taken only for packed bf16 CPU matmuls (``linear.packs``) with ``fast_paths(dense_experts=...)`` on,
``experts <= tokens * k`` and ``tokens * experts <= DENSE_PAIRS``; each token's output is the sum over its chosen
experts of ``weight * expert(x)``, as the routed path's, within bf16 rounding (one rounding of the sum instead of one
per term); the stacked weights are derived (made again after the experts' weights change).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.layers.linear import packs
from hybridkv.engine.layers.norms import derived

DENSE_PAIRS = 512
"""``tokens * experts`` up to which the experts run densely (the widened Qwen3-Next's 8 experts: up to 64 tokens)."""


def dense_takes(x: torch.Tensor, gate_up: torch.Tensor, top_k: int) -> bool:
    """Whether ``x (T, H)``, each token routed to ``top_k`` of the experts ``gate_up (E, 2I, H)``, takes the dense
    path: enough pairs (``T * top_k >= E``) that most experts would run anyway, few enough tokens (``DENSE_PAIRS``)."""
    tokens, experts = x.shape[0], gate_up.shape[0]
    return (
        FAST.dense_experts
        and experts <= tokens * top_k
        and tokens * experts <= DENSE_PAIRS
        and x.dtype == torch.bfloat16
        and packs(x, gate_up[0])
    )


def dense_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    owner: nn.Module,
) -> torch.Tensor:
    """``x (T, H)``, each token's experts ``index (T, k)`` and ``weights (T, k)`` (x's dtype), experts
    ``gate_up (E, 2I, H)`` (gate rows first) and ``down (E, H, I)`` -> ``(T, H)``: the weighted sum of its experts."""
    tokens, (experts, inner_size) = x.shape[0], down.shape[::2]
    stacked_gate_up = derived(
        owner,
        "_dense_gate_up",
        (gate_up,),
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w.reshape(-1, w.shape[2]).contiguous()),
    )
    stacked_down = derived(
        owner,
        "_dense_down",
        (down,),
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w.permute(1, 0, 2).reshape(w.shape[1], -1).contiguous()),
    )
    both = torch.ops.mkldnn._linear_pointwise(x, stacked_gate_up, None, "none", [], "").view(tokens, experts, 2, -1)
    inner = act(both[:, :, 0]) * both[:, :, 1]
    chosen = torch.zeros(tokens, experts, dtype=inner.dtype, device=x.device)
    chosen = chosen.scatter_add_(1, index, weights.to(inner.dtype))
    inner = (inner * chosen.unsqueeze(-1)).view(tokens, experts * inner_size)
    return torch.ops.mkldnn._linear_pointwise(inner, stacked_down, None, "none", [], "")
