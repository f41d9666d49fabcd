"""The MLP activations: ``gelu_tanh``'s sigmoid form is transformers' tanh GELU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.layers.mlp import GELU_TANH_SPLIT, activation


@pytest.mark.parametrize("rows", [1, GELU_TANH_SPLIT // 128, 1024])  # below, at and far beyond the split
def test_gelu_tanh_equals_the_tanh_gelu_kernel(rows: int) -> None:
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) * 4  # the tails too
    x[0, :4] = torch.tensor([0.0, -0.0, 30.0, -30.0])
    got, want = activation("gelu_pytorch_tanh")(x), F.gelu(x, approximate="tanh")
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float((got - want).abs().max()) < 2e-6 * max(1.0, float(want.abs().max()))
    assert torch.isfinite(got).all()


def test_gelu_tanh_keeps_its_gradient() -> None:  # the modules stay usable with autograd outside the runner
    x = torch.randn(64, 128, requires_grad=True)
    activation("gelu_pytorch_tanh")(x).sum().backward()
    y = x.detach().clone().requires_grad_(True)
    F.gelu(y, approximate="tanh").sum().backward()
    assert x.grad is not None and y.grad is not None and torch.allclose(x.grad, y.grad, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gelu_tanh_in_half_precision_is_the_kernel_itself(dtype: torch.dtype) -> None:
    # each step of the sigmoid form would round to the half dtype: 2-4% off in bf16 where the kernel rounds once
    x = torch.linspace(-12, 12, 4 * GELU_TANH_SPLIT, dtype=torch.float32).to(dtype)
    assert torch.equal(activation("gelu_pytorch_tanh")(x), F.gelu(x, approximate="tanh"))
