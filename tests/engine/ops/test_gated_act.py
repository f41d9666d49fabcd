"""The fused gated activation (``ops.gated_act``): ``act(gate) * up`` for tanh GELU and SiLU, rounded once in bf16
(at least as close to fp32 as the torch path), within a few ulp in fp32, rows read in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.layers.mlp import GatedMLP
from hybridkv.engine.ops.gated_act import KERNEL_ACTS, fuses_act, gated_act
from hybridkv.engine.ops.native import native

TORCH = {"gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh"), "silu": F.silu}


def _exact(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` in fp64; the tanh GELU in its sigmoid form (its tanh form underflows to 0 for gate below
    about -8, where the value is ~1e-21 and less)."""
    g = gate.double()
    if act == "silu":
        return F.silu(g) * up.double()
    return g * torch.sigmoid(1.5957691216057308 * (g + 0.044715 * g**3)) * up.double()


def _kernels() -> None:
    if native() is None:
        pytest.skip("no C++ compiler here: the torch path serves")


def _inputs(rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(rows, width, generator=g) * 4, torch.randn(rows, width, generator=g)
    gate[0, :6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 200.0, -200.0])  # the tails: exp saturates
    return gate, up


@pytest.mark.parametrize("act", sorted(KERNEL_ACTS))
def test_fp32_is_torchs_within_a_few_ulp(act: str) -> None:
    _kernels()
    gate, up = _inputs(257, 1000, 0)
    assert fuses_act(gate, up, act)
    got = gated_act(gate, up, act)
    want = _exact(act, gate, up)
    err = (got.double() - want).abs()
    # fp32's rounding of the sigmoid's argument v moves exp(-v) by |v| ulp: the tail's bound (torch's is looser still)
    v = 1.5957691216057308 * (gate + 0.044715 * gate**3) if act != "silu" else gate
    bound = 8 * torch.finfo(torch.float32).eps * want.abs() * (1 + v.double().abs())
    assert float((err - bound).max()) <= 1e-30
    assert float(err.mean()) <= float((TORCH[act](gate) * up - want).abs().mean()) * 1.05
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("act", sorted(KERNEL_ACTS))
def test_bf16_rounds_once_and_is_at_least_as_close_to_fp32_as_torch(act: str) -> None:
    _kernels()
    gate, up = (t.to(torch.bfloat16) for t in _inputs(300, 512, 1))
    got = gated_act(gate, up, act)
    torch_path = TORCH[act](gate) * up
    want = _exact(act, gate, up)
    assert got.dtype == torch.bfloat16
    _, exponent = torch.frexp(want.abs().clamp_min(1e-30))
    ulps = (got.double() - want).abs() / torch.ldexp(torch.ones_like(want), exponent - 8)
    assert float(ulps.max()) <= 0.51  # rounded once, from fp32 within a few of its ulp
    assert float((got.double() - want).abs().mean()) < float((torch_path.double() - want).abs().mean())
    torch.testing.assert_close(got, torch_path)  # bf16's tolerance


def test_the_halves_of_a_joined_projection_are_read_in_place() -> None:
    _kernels()
    joined = torch.randn(33, 2 * 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    gate, up = joined[:, :300], joined[:, 300:]
    assert gate.stride(0) == 600
    assert torch.equal(gated_act(gate, up, "silu"), gated_act(gate.contiguous(), up.contiguous(), "silu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_takes_the_kernel_and_the_switch_restores_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    mlp = GatedMLP(64, 96, "gelu_pytorch_tanh").to(dtype)
    x = torch.randn(9, 64, dtype=dtype)
    with torch.no_grad():
        fused = mlp(x)
        with fast_paths(fused_activations=False):
            plain = mlp(x)
            assert torch.equal(plain, mlp.down_proj(mlp.act(mlp.gate_proj(x)) * mlp.up_proj(x)))
    scale = float(plain.abs().max())  # the down projection's sums cancel: a tolerance of the output's scale
    torch.testing.assert_close(fused, plain, atol=scale * (1e-6 if dtype == torch.float32 else 2**-7), rtol=0)


def test_the_torch_path_serves_where_the_kernel_does_not_apply() -> None:
    gate = up = torch.randn(4, 8)
    assert not fuses_act(gate, up, "relu2")
    assert not fuses_act(gate.half(), up.half(), "silu")
    assert not fuses_act(gate, up.bfloat16(), "silu")
    assert not fuses_act(gate[None], up[None], "silu")
    assert not fuses_act(gate.requires_grad_(), up, "silu")  # autograd: torch's ops
    with fast_paths(native_kernels=False):
        assert not fuses_act(torch.randn(4, 8), torch.randn(4, 8), "silu")
