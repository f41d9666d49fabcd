"""NoRope: the rope of a model whose attention has no positional encoding (NoPE).

Nemotron-H's attention and Kimi-Linear's MLA apply no rotary embedding. The shared model
frame hands every attention layer ``(cos, sin)``; a zero-width pair rotates no dimension,
so ``apply_rope`` returns q and k unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


class NoRope(nn.Module):
    rotary_dim = 0

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: ``(T, 0)``."""
        empty = torch.empty(positions.shape[0], 0, dtype=torch.float32, device=positions.device)
        return empty, empty
