"""``layers.dense_moe``: Qwen3-Next's experts of a few tokens run densely equal the routed path within bf16 rounding,
and only where they should (packed bf16 CPU matmuls, few tokens, the switch on)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.layers.dense_moe import DENSE_PAIRS, dense_experts, dense_takes
from hybridkv.engine.layers.linear import packs
from hybridkv.engine.layers.mlp import SoftmaxTopKMoE

EXPERTS, HIDDEN, INNER = 8, 64, 32


def _moe() -> SoftmaxTopKMoE:
    torch.manual_seed(3)
    moe = SoftmaxTopKMoE(HIDDEN, INNER, EXPERTS, 2, True, "silu", INNER)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return moe.to(torch.bfloat16)


needs_packed = pytest.mark.skipif(
    not packs(torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16)),
    reason="oneDNN bf16 (the packed path) not on this CPU",
)


@needs_packed
@pytest.mark.parametrize("tokens", [4, 5, 16])
def test_dense_equals_routed_within_bf16_rounding(tokens: int) -> None:
    moe = _moe()
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    fp32 = _moe().float()
    with torch.no_grad():
        want = fp32(x.float())
        with fast_paths(dense_experts=False):
            routed = moe(x)
        dense = moe(x)
        assert dense_takes(x, moe.gate_up_proj, 2)
    scale = want.abs().max().item()
    assert (dense.float() - routed.float()).abs().max().item() <= scale * 2**-5  # a few bf16 roundings apart
    # at least as close to fp32 as the routed path (one rounding of the sum, not one per expert)
    assert (dense.float() - want).abs().mean() <= (routed.float() - want).abs().mean() * 1.05


@needs_packed
def test_the_experts_alone_are_each_tokens_weighted_sum() -> None:
    moe = _moe()
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(9)).bfloat16()
    index = torch.tensor([[0, 7], [3, 3], [5, 1]])  # an expert twice: both its weights count
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]]).bfloat16()
    with torch.no_grad():
        got = dense_experts(x, index, weights, moe.gate_up_proj, moe.down_proj, moe.act, moe)
        want = torch.zeros(3, HIDDEN)
        for t in range(3):
            for e, w in zip(index[t].tolist(), weights[t].float().tolist(), strict=True):
                gate, up = (x[t].float() @ moe.gate_up_proj[e].float().T).chunk(2)
                want[t] += w * (moe.act(gate) * up) @ moe.down_proj[e].float().T
    assert (got.float() - want).abs().max().item() <= want.abs().max().item() * 2**-5


def test_taken_only_for_few_packed_bf16_tokens_with_the_switch_on() -> None:
    moe = _moe()
    few = torch.zeros(DENSE_PAIRS // EXPERTS, HIDDEN, dtype=torch.bfloat16)
    many = torch.zeros(DENSE_PAIRS // EXPERTS + 1, HIDDEN, dtype=torch.bfloat16)
    assert dense_takes(few, moe.gate_up_proj, 2) == packs(few, moe.gate_up_proj[0])
    assert not dense_takes(many, moe.gate_up_proj, 2)
    assert not dense_takes(few.float(), moe.gate_up_proj.float(), 2)
    # too few pairs to touch most experts: the routed path reads fewer weights
    assert not dense_takes(few[: EXPERTS // 2 - 1], moe.gate_up_proj, 2)
    assert dense_takes(few[: EXPERTS // 2], moe.gate_up_proj, 2) == packs(few, moe.gate_up_proj[0])
    with fast_paths(dense_experts=False):
        assert not dense_takes(few, moe.gate_up_proj, 2)
