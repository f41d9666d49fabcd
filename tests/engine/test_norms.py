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


def test_a_bf16_norm_on_the_cpu_is_the_reference_within_bf16() -> None:
    from hybridkv.engine.fast_paths import fast_paths
    from hybridkv.engine.layers.norms import rms_norm_rounded, rounds_norm

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6, offset=True)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 0.1)
    x = (torch.randn(300, 64) * 3).to(torch.bfloat16)
    assert rounds_norm(x) and not rounds_norm(x.float())
    want = _reference(x, norm.weight, 1e-6)
    with fast_paths(fused_norms=False):  # the in-place torch path (the fused kernel: tests/engine/ops/test_rms_norm)
        got = norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)  # bf16's tolerance
    with fast_paths(rms_norms=False):
        assert not rounds_norm(x)
        assert torch.equal(norm(x), got)  # torch's composite: the same ops, the same bits
    heads = (torch.randn(5, 3, 16) * 2).to(torch.bfloat16)  # per-head scales, as the q/k norms use them
    kept = heads.clone()
    scale = 1.0 + torch.randn(3, 16) * 0.1
    h = heads.float()
    with fast_paths(fused_norms=False):
        rounded = rms_norm_rounded(heads, scale, 1e-6)
    torch.testing.assert_close(
        rounded,
        (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * scale).to(torch.bfloat16),
    )
    assert torch.equal(heads, kept)  # the input is not written
