"""NoRope: the rope of a model whose attention has no positional encoding (NoPE).

Nemotron-H's attention and Kimi-Linear's MLA apply no rotary embedding; the shared model
frame hands every attention layer its rope's tables, and ``NO_ROTATION`` leaves q and k
unchanged (``apply_rope`` returns them as they are).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.engine.layers.rope import NO_ROTATION, RopeTables


class NoRope(nn.Module):
    rotary_dim = 0

    def forward(self, positions: torch.Tensor) -> RopeTables:
        return NO_ROTATION
