"""RMS norms: the offset norm's cached ``1 + w`` follows its weight (a load writes it, a conversion replaces it)."""

from __future__ import annotations

import torch

from hybridkv.engine.layers.norms import RMSNorm


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


def test_the_offset_scale_follows_the_weight() -> None:
    norm = RMSNorm(8, 1e-6, offset=True)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), _reference(x, norm.weight, 1e-6))
    with torch.no_grad():
        norm.weight.copy_(torch.arange(8.0))  # what the weight loader does
    torch.testing.assert_close(norm(x), _reference(x, norm.weight, 1e-6))
    norm.to(torch.float64)  # a conversion gives the parameter new storage
    torch.testing.assert_close(norm(x.double()), _reference(x.double(), norm.weight, 1e-6))
