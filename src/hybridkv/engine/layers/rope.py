"""Rotary position embeddings from a config's ``rope_parameters`` (default, linear, yarn).

Invariants: the inverse frequencies and the cos/sin scaling equal ``transformers``' rope
init functions for the supported types (computed on the CPU at construction, also when the model
is built on the meta device: they are not weights); a partial rotary factor rotates only the first
``rotary_dim`` dims of each head (Qwen3-Next); cos/sin are computed in fp32 from positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _yarn(params: dict[str, Any], dim: int, base: float, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor") or max_pos / params["original_max_position_embeddings"]
    original = params["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class Rope(nn.Module):
    def __init__(self, params: dict[str, Any], head_dim: int, max_position_embeddings: int):
        super().__init__()
        kind = params.get("rope_type", "default")
        base = float(params["rope_theta"])
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        self.rotary_dim = dim
        with torch.device("cpu"):  # computed, not loaded: real values even in a model built on meta
            if kind in ("default", "linear"):
                inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
                if kind == "linear":
                    inv_freq = inv_freq / params["factor"]
                scaling = 1.0
            elif kind == "yarn":
                inv_freq, scaling = _yarn(params, dim, base, max_position_embeddings)
            else:
                raise ValueError(f"rope_type {kind!r} is not supported by the engine (default, linear, yarn)")
        self.scaling = scaling
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: ``(T, rotary_dim)`` for flat positions ``(T,)``."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, heads, head_dim)``'s first ``cos.shape[-1]`` dims (rotate-half layout)."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None].to(x.dtype) + rotated * sin[:, None].to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
