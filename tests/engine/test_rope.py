"""``apply_rope``'s sliced rotate-half equals the rotation written with each dim's partner index."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.layers.rope import NO_ROTATION, Rope, apply_rope


@pytest.mark.parametrize("factor", [1.0, 0.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_rotate_half_equals_the_partner_gather(factor: float, dtype: torch.dtype) -> None:
    head_dim = 32
    rope = Rope({"rope_theta": 10000.0, "partial_rotary_factor": factor}, head_dim, 512)
    tables = rope(torch.arange(7) * 13)
    x = torch.randn(7, 3, head_dim).to(dtype)
    dim = int(head_dim * factor)
    half = dim // 2
    partner = torch.cat([torch.arange(half, dim), torch.arange(half), torch.arange(dim, head_dim)])
    assert tables.cos is not None and tables.sin is not None
    want = torch.addcmul(x * tables.cos.to(dtype), x.index_select(-1, partner), tables.sin.to(dtype))
    assert torch.equal(apply_rope(x, tables), want)
    assert apply_rope(x, NO_ROTATION) is x
