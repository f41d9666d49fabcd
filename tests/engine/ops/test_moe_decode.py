"""A decode's routed experts in one call (``ops.moe_decode``): each token's weighted sum of its chosen experts' gated
MLPs, within the dtype's rounding of the exact value; Qwen3-Next's MoE takes it for up to four tokens and agrees with
the routed path; every malformed argument refused, naming both sides."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.layers.mlp import SoftmaxTopKMoE
from hybridkv.engine.ops.moe_decode import DECODE_TOKENS, moe_decode_takes, moe_experts
from hybridkv.engine.ops.native import native


def _kernels() -> None:
    if native() is None:
        pytest.skip("no C++ compiler here: the routed path serves")


def _exact(
    x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str
) -> torch.Tensor:
    """The fp64 sum over each token's experts of ``weight * down(act(gate) * up)``."""
    fn = F.silu if act == "silu" else (lambda g: F.gelu(g, approximate="tanh"))
    inner_size = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            both = gate_up[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (down[e].double() @ (fn(both[:inner_size]) * both[inner_size:]))
    return out


def _case(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    experts, hidden, inner_size, k = 6, 80, 36, 2  # odd widths: the kernel's vector tails
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inner_size, hidden, generator=g) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inner_size, generator=g) / inner_size**0.5).to(dtype)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).to(dtype)
    return x, index, weights, gate_up, down


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 2, DECODE_TOKENS])
def test_each_token_is_its_experts_weighted_sum_within_rounding(tokens: int, dtype: torch.dtype, act: str) -> None:
    _kernels()
    x, index, weights, gate_up, down = _case(tokens, dtype, tokens)
    assert moe_decode_takes(x, gate_up, down, act)
    got = moe_experts(x, index, weights, gate_up, down, act)
    want = _exact(x, index, weights, gate_up, down, act)
    # bf16: the gate/up, the inner activation and each expert's output rounded (three roundings of 2**-8 relative,
    # each carried through the next product), the sum once; fp32: summation order only
    tolerance = 2**-5 if dtype == torch.bfloat16 else 1e-5
    assert got.shape == x.shape and got.dtype == dtype
    assert float((got.double() - want).abs().max()) <= tolerance * float(want.abs().max())


def test_qwen3_next_moe_takes_it_for_a_decode_and_agrees_with_the_routed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _kernels()
    from hybridkv.engine.layers import mlp

    torch.manual_seed(0)
    moe = SoftmaxTopKMoE(96, 48, 8, 2, True, "silu", 32).to(torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    calls: list[int] = []

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return moe_experts(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(mlp, "moe_experts", counted)
    with torch.inference_mode():
        for tokens in (1, 3, DECODE_TOKENS, DECODE_TOKENS + 1):
            x = torch.randn(tokens, 96).bfloat16()
            fused = moe(x).float()
            with fast_paths(fused_experts=False, dense_experts=False):
                routed = moe(x).float()
            assert float((fused - routed).abs().max()) <= 2**-6 * float(routed.abs().max()), tokens
    assert calls == [1, 3, DECODE_TOKENS]  # more tokens: the dense or routed path


def test_not_taken_where_it_does_not_apply() -> None:
    _kernels()
    x, _, _, gate_up, down = _case(1, torch.bfloat16, 0)
    assert not moe_decode_takes(x, gate_up, down, "relu2")  # an activation the kernel does not compute
    assert not moe_decode_takes(x.float(), gate_up, down, "silu")  # weights of another dtype
    assert not moe_decode_takes(x.half(), gate_up.half(), down.half(), "silu")
    assert not moe_decode_takes(x, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down, "silu")  # (in, out)
    assert not moe_decode_takes(x.new_zeros(0, x.shape[1]), gate_up, down, "silu")
    with fast_paths(fused_experts=False):
        assert not moe_decode_takes(x, gate_up, down, "silu")
    with fast_paths(native_kernels=False):
        assert not moe_decode_takes(x, gate_up, down, "silu")


def test_malformed_arguments_are_refused_naming_both_sides() -> None:
    _kernels()
    ops = native()
    assert ops is not None
    x, index, weights, gate_up, down = _case(2, torch.float32, 1)
    with pytest.raises(RuntimeError, match=r"expert 6 \(entry 1 of index\) is outside the 6 experts"):
        ops.moe_experts(x, torch.tensor([[0, 6], [1, 2]]), weights, gate_up, down, "silu")
    with pytest.raises(RuntimeError, match="expert -1"):
        ops.moe_experts(x, torch.tensor([[0, 1], [-1, 2]]), weights, gate_up, down, "silu")
    with pytest.raises(RuntimeError, match=r"x \(2, 80\) against gate_up \[6, 72, 80\] and down \[6, 79, 36\]"):
        ops.moe_experts(x, index, weights, gate_up, down[:, :79], "silu")
    with pytest.raises(RuntimeError, match=r"gate_up .* of x.s Float"):
        ops.moe_experts(x, index, weights, gate_up.bfloat16(), down, "silu")
    with pytest.raises(RuntimeError, match=r"weights a contiguous Float tensor of index's shape \[2, 2\]"):
        ops.moe_experts(x, index, weights[:, :1].contiguous(), gate_up, down, "silu")
    with pytest.raises(RuntimeError, match="index a contiguous int64"):
        ops.moe_experts(x, index.int(), weights, gate_up, down, "silu")
    with pytest.raises(RuntimeError, match="act is gelu_tanh or silu, got relu"):
        ops.moe_experts(x, index, weights, gate_up, down, "relu")
