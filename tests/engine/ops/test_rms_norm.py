"""The fused bf16 RMS norm (``ops.rms_norm``): within bf16 rounding of the torch path, at least as close to the fp32
norm, its residual add torch's bf16 add bit for bit, per-head scale blocks, and the torch path wherever it does not
apply; the gated norm (GatedDeltaNet's output) within the dtype's rounding of ``GatedRMSNorm``'s torch path, its gate
read through a projection's strides, every malformed argument refused."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.layers.norms import GatedRMSNorm, RMSNorm, rms_norm_rounded
from hybridkv.engine.ops.native import native
from hybridkv.engine.ops.rms_norm import fuses_gated_norm, fuses_norm, gated_rms_norm_fused, rms_norm_fused


def _kernels() -> None:
    if native() is None:
        pytest.skip("no C++ compiler here: the torch path serves")


def _fp32_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm in fp64, rounded to fp32."""
    h = x.double()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * scale.double().view(-1, x.shape[-1])).float()


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of bf16's spacing at ``want``."""
    _, exponent = torch.frexp(want.double().abs().clamp_min(1e-30))
    return (got.double() - want.double()).abs() / torch.ldexp(torch.ones_like(want.double()), exponent - 8)


@pytest.mark.parametrize("width", [1, 17, 128, 512, 1000])
def test_the_kernel_is_the_torch_path_within_bf16_and_at_least_as_close_to_fp32(width: int) -> None:
    _kernels()
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(300, width, generator=g) * 3).to(torch.bfloat16)
    x[0] = 0.0  # an all-zero row: eps alone
    scale = 1.0 + torch.randn(width, generator=g) * 0.1
    assert fuses_norm(x, scale)
    got = rms_norm_rounded(x, scale, 1e-6)
    with fast_paths(fused_norms=False):
        assert not fuses_norm(x, scale)
        torch_path = rms_norm_rounded(x, scale, 1e-6)
    want = _fp32_norm(x, scale, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert float(_bf16_ulps(got, torch_path).max()) <= 1.0  # at most one bf16 step apart, and rarely
    assert float((got != torch_path).float().mean()) < 0.01
    assert float((got.float() - want).abs().mean()) <= float((torch_path.float() - want).abs().mean())
    assert float(_bf16_ulps(got, want).max()) <= float(_bf16_ulps(torch_path, want).max())
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_fp32_is_torchs_norm_within_two_ulp() -> None:
    _kernels()
    g = torch.Generator().manual_seed(3)
    x, scale = torch.randn(200, 512, generator=g) * 3, 1.0 + torch.randn(512, generator=g) * 0.1
    assert fuses_norm(x, scale)
    got = rms_norm_fused(x, scale, 1e-6)
    want = torch.nn.functional.rms_norm(x, (512,), scale, 1e-6)
    assert got.dtype == torch.float32
    assert float(((got - want).abs() / want.abs().clamp_min(1e-30)).max()) <= 2.5 * torch.finfo(torch.float32).eps
    exact = _fp32_norm(x, scale, 1e-6).double()  # (in fp64 here)
    assert float((got.double() - exact).abs().mean()) <= float((want.double() - exact).abs().mean()) * 1.05


def test_the_residual_add_is_torchs_bf16_add_of_the_rounded_norm() -> None:
    _kernels()
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 256, generator=g) * 5).to(torch.bfloat16)
    residual = (torch.randn(64, 256, generator=g) * 40).to(torch.bfloat16)
    scale = torch.randn(256, generator=g)
    normed = rms_norm_fused(x, scale, 1e-5)
    assert torch.equal(rms_norm_fused(x, scale, 1e-5, residual), residual + normed)
    norm = RMSNorm(256, 1e-5, offset=True)
    with torch.no_grad():
        norm.weight.copy_(scale - 1.0)
    assert torch.equal(norm(x, residual=residual), residual + norm(x))
    with fast_paths(fused_norms=False):  # the torch path: the same add, after its own norm
        assert torch.equal(norm(x, residual=residual), residual + norm(x))
    x32, r32 = x.float(), residual.float()  # fp32: the same add after the kernel's fp32 norm
    assert torch.equal(norm(x32, residual=r32), r32 + norm(x32))


def test_per_head_scales_take_each_rows_block() -> None:  # q/k norms: (T, heads, D), a scale per head
    _kernels()
    g = torch.Generator().manual_seed(2)
    heads = (torch.randn(7, 6, 128, generator=g) * 2).to(torch.bfloat16)
    scale = 1.0 + torch.randn(6, 128, generator=g) * 0.1
    got = rms_norm_fused(heads, scale, 1e-6)
    for h in range(6):
        assert torch.equal(got[:, h], rms_norm_fused(heads[:, h].contiguous(), scale[h], 1e-6))
    torch.testing.assert_close(got.float(), _fp32_norm(heads, scale, 1e-6).view(7, 6, 128), atol=0, rtol=2**-8)


def test_the_torch_path_serves_where_the_kernel_does_not_apply() -> None:
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    scale = torch.ones(32)
    assert not fuses_norm(x.half(), scale)
    assert not fuses_norm(x, None)
    assert not fuses_norm(x, scale.double())
    assert not fuses_norm(x, torch.ones(3 * 32))  # 4 rows are not a whole number of 3 scale blocks
    assert not fuses_norm(x, scale, torch.zeros(1, 32, dtype=torch.bfloat16))  # a broadcast residual: torch adds
    with fast_paths(native_kernels=False):
        assert not fuses_norm(x, scale)
    with pytest.raises(RuntimeError, match="scale"):
        if native() is None:
            raise RuntimeError("scale")
        rms_norm_fused(x, torch.ones(31), 1e-6)


def _gated_case(dtype: torch.dtype, width: int, seed: int) -> tuple[GatedRMSNorm, torch.Tensor, torch.Tensor]:
    """A norm, x (T, 6, D) and its gate as GatedDeltaNet passes it: a (T, 2, 3, D) view of a wider projection (two
    key heads of three value heads each: the two middle dimensions differ, so swapping them would be caught)."""
    g = torch.Generator().manual_seed(seed)
    norm = GatedRMSNorm(width, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + torch.randn(width, generator=g) * 0.3)
    x = (torch.randn(70, 6, width, generator=g) * 3).to(dtype)
    x[0, 0] = 0.0  # an all-zero row: eps alone
    projection = (torch.randn(70, 2, 7 * width, generator=g) * 4).to(dtype)
    return norm, x, projection[..., width : 4 * width].view(70, 2, 3, width)


@pytest.mark.parametrize("width", [1, 17, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gated_kernel_is_the_torch_path_within_rounding(dtype: torch.dtype, width: int) -> None:
    _kernels()
    norm, x, gate = _gated_case(dtype, width, width)
    assert not fuses_gated_norm(x, norm.weight, gate)  # a weight that records gradients keeps the torch path
    with torch.no_grad():
        assert not gate.is_contiguous() and fuses_gated_norm(x, norm.weight, gate)
        got = norm(x, gate)
        with fast_paths(fused_norms=False):
            assert not fuses_gated_norm(x, norm.weight, gate)
            torch_path = norm(x, gate)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:  # the same roundings in the same order; the mean of squares and exp within an ulp
        assert float(_bf16_ulps(got, torch_path).max()) <= 1.0
        assert float((got != torch_path).float().mean()) < 0.01
    else:
        assert torch.allclose(got, torch_path, rtol=1e-5, atol=1e-6), float((got - torch_path).abs().max())
    for same in (gate.reshape(x.shape).contiguous(), gate.reshape(-1, width)):  # 3-D and 2-D gates of x's rows
        assert torch.equal(got, gated_rms_norm_fused(x, norm.weight.detach(), same, 1e-6))


def test_a_wrong_gate_or_weight_is_refused_naming_it() -> None:
    _kernels()
    norm, x, gate = _gated_case(torch.bfloat16, 16, 3)
    kernels = native()
    assert kernels is not None
    norm.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"a contiguous CPU weight of x's BFloat16 and D = 16 entries, got Float"):
        kernels.gated_rms_norm(x, norm.weight.float(), gate, 1e-6)
    with pytest.raises(RuntimeError, match=r"gate \(T, A, B, 16\) of 420 rows.*\[69, 2, 3, 16\]"):
        kernels.gated_rms_norm(x, norm.weight, gate[1:], 1e-6)
    every_other = torch.zeros(70, 2, 3, 32, dtype=torch.bfloat16)[..., ::2]  # rows not contiguous
    with pytest.raises(
        RuntimeError, match=r"each contiguous, got BFloat16 \[70, 2, 3, 16\] strides \[192, 96, 32, 2\]"
    ):
        kernels.gated_rms_norm(x, norm.weight, every_other, 1e-6)
    with torch.no_grad():  # the layer's torch path serves those instead
        assert fuses_gated_norm(x, norm.weight, gate)
        assert not fuses_gated_norm(x, norm.weight.float(), gate)
        assert not fuses_gated_norm(x, norm.weight, gate[1:])
        assert not fuses_gated_norm(x[..., :0], norm.weight[:0], gate[..., :0])  # no width: nothing to normalise
        assert not fuses_gated_norm(x, norm.weight, torch.tensor(1.0, dtype=torch.bfloat16))  # a 0-d gate
