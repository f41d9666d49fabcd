"""The fused q/k norm and rotation (``ops.qk_rope``): within bf16 rounding of the torch path (concatenate, norm,
``apply_rope``), at least as close to the fp64 norm-and-rotation, for full and partial rotary dims, a query view
beside its output gate, and no norm."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.layers.norms import rms_norm_rounded
from hybridkv.engine.layers.rope import Rope, RopeTables, apply_rope
from hybridkv.engine.ops.native import native
from hybridkv.engine.ops.qk_rope import fuses_qk_rope, qk_rope

ROPES = {
    "full": ({"rope_type": "default", "rope_theta": 10000.0}, 1.0),
    "partial": ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}, 1.0),
    "yarn": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}, 1.0),
}


def _exact(qk: torch.Tensor, scale: torch.Tensor | None, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm and the rotation in fp64 from the bf16 inputs, and the size of its two terms (a rotated entry near
    zero is a difference of two: each path's rounding is relative to them, not to it)."""
    x = qk.double()
    if scale is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale.double()
    assert rope.cos is not None and rope.sin is not None and rope.rotary is not None
    half, dim = rope.rotary // 2, rope.rotary
    rotated = torch.cat((x[..., half:dim], x[..., :half], x[..., dim:]), dim=-1)
    cos, sin = rope.cos.double(), rope.sin.double()
    return x * cos + rotated * sin, (x * cos).abs() + (rotated * sin).abs()


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("normed", [True, False])
def test_the_kernel_is_the_torch_path_within_bf16_and_closer_to_fp64(kind: str, normed: bool) -> None:
    if native() is None:
        pytest.skip("no C++ compiler here: the torch path serves")
    g = torch.Generator().manual_seed(len(kind) + normed)
    t, heads, kv, d = 37, 4, 2, 128
    rope = Rope(ROPES[kind][0], d, 512)(torch.randint(0, 500, (t,), generator=g))
    gated = (torch.randn(t, heads, 2 * d, generator=g) * 3).to(torch.bfloat16)
    q = gated[..., :d]  # a query view beside its output gate (Qwen3-Next): rows of their own stride
    k = (torch.randn(t, kv, d, generator=g) * 3).to(torch.bfloat16)
    scale = (1.0 + torch.randn(heads + kv, d, generator=g) * 0.1) if normed else None
    assert fuses_qk_rope(q, k)
    assert rope.cos is not None and rope.sin is not None and rope.rotary is not None
    got = qk_rope(q, k, scale, 1e-6, rope.cos, rope.sin, rope.rotary)
    qk = torch.cat((q, k), dim=1)
    torch_path = apply_rope(rms_norm_rounded(qk, scale, 1e-6) if scale is not None else qk, rope)
    want, terms = _exact(qk, scale, rope)
    assert got.shape == (t, heads + kv, d) and got.dtype == torch.bfloat16 and got.is_contiguous()
    # the torch path rounds the norm, cos, sin, each product and the sum to bf16: a few of its steps apart
    assert bool(((got.double() - torch_path.double()).abs() <= 2**-5 * terms).all())
    assert float((got.double() - want).abs().mean()) <= float((torch_path.double() - want).abs().mean())
    assert float((got.double() - want).abs().max()) <= float((torch_path.double() - want).abs().max())
    if not normed and kind == "partial":  # beyond the rotary dims cos is 1: the inputs pass through
        assert torch.equal(got[..., rope.rotary :], qk[..., rope.rotary :])


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_fp32_is_the_torch_path_within_a_few_ulp(kind: str) -> None:
    if native() is None:
        pytest.skip("no C++ compiler here: the torch path serves")
    g = torch.Generator().manual_seed(7)
    t, heads, kv, d = 21, 4, 2, 64
    rope = Rope(ROPES[kind][0], d, 512)(torch.randint(0, 500, (t,), generator=g))
    q, k = torch.randn(t, heads, d, generator=g) * 3, torch.randn(t, kv, d, generator=g) * 3
    scale = 1.0 + torch.randn(heads + kv, d, generator=g) * 0.1
    assert fuses_qk_rope(q, k) and rope.cos is not None and rope.sin is not None and rope.rotary is not None
    got = qk_rope(q, k, scale, 1e-6, rope.cos, rope.sin, rope.rotary)
    qk = torch.cat((q, k), dim=1)
    torch_path = apply_rope(torch.nn.functional.rms_norm(qk, (d,), None, 1e-6) * scale, rope)
    _, terms = _exact(qk, scale, rope)
    assert got.dtype == torch.float32
    assert bool(((got.double() - torch_path.double()).abs() <= 4 * torch.finfo(torch.float32).eps * terms).all())


def test_the_torch_path_serves_where_the_kernel_does_not_apply() -> None:
    q, k = torch.randn(3, 4, 16, dtype=torch.bfloat16), torch.randn(3, 2, 16, dtype=torch.bfloat16)
    assert not fuses_qk_rope(q.float(), k)  # one dtype for both
    assert not fuses_qk_rope(q.half(), k.half())
    assert not fuses_qk_rope(q.transpose(1, 2), k)
    with fast_paths(fused_rope=False):
        assert not fuses_qk_rope(q, k)
    with fast_paths(native_kernels=False):
        assert not fuses_qk_rope(q, k)
    if native() is not None:
        with pytest.raises(RuntimeError, match="scale"):
            ones = torch.ones(3, 1, 16)
            qk_rope(q, k, torch.ones(5, 16), 1e-6, ones, ones * 0, 16)
