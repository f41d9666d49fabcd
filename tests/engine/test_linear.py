"""Packed linears (``engine.layers.linear``): bf16 the same numbers as ``F.linear``, kept valid across weight loads;
fp32 only inside its row and size bounds, within fp32 rounding of ``F.linear``; off wherever they do not apply (a
small fp32 call, a graph being traced, ``fast_paths(packed_linears=False)`` / ``fast_paths(packed_fp32=False)``).
A decode's few rows take the skinny kernel first (``tests/engine/ops/test_skinny_linear.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.cpuinfo import field
from hybridkv.engine.engine import Engine
from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.layers import linear as packed
from hybridkv.engine.layers.linear import Linear, packs
from hybridkv.engine.random_models import build_random, quiet_transformers

ONEDNN_BF16 = packed._onednn_bf16()
needs_onednn = pytest.mark.skipif(not ONEDNN_BF16, reason="this CPU's oneDNN has no native bf16")
needs_onednn_fp32 = pytest.mark.skipif(not packed._onednn(), reason="this torch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    with torch.inference_mode(), fast_paths(skinny_linears=False):  # one row: else the skinny kernel's (its tests)
        assert packs(x, layer.weight)
        got = layer(x)
        assert "_packed" in layer.__dict__
        with fast_paths(packed_linears=False):
            assert not packs(x, layer.weight)
            want = layer(x)
    torch.testing.assert_close(got, want)  # bf16's tolerance (bit-equal on the machines measured)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_packed_weight_follows_a_reload_and_a_conversion() -> None:
    torch.manual_seed(0)
    layer = Linear(32, 16, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        layer(x)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(16, 32, dtype=torch.bfloat16))  # a load writes in place
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
        layer.to(torch.float32).to(torch.bfloat16)  # a conversion replaces the storage
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_fp32_keeps_f_linear() -> None:
    torch.manual_seed(0)
    layer = Linear(32, 16)
    x = torch.randn(5, 32)
    assert not packs(x, layer.weight)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert "_packed" not in layer.__dict__


@needs_onednn_fp32
@pytest.mark.parametrize("rule", [packed.MKL_FULL_WIDTH, packed.MKL_NARROW], ids=["full-width", "narrow"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_fp32_inside_its_bounds_only(
    rule: packed.Fp32Packing, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packed, "fp32_packing", lambda: rule)
    torch.manual_seed(0)
    width = 512
    # the fewest columns a call of the rule's fewest rows needs to be packed, and a layer of them
    out = -(-rule.least_macs // (rule.least_rows * width))
    layer = Linear(width, out, bias=bias)
    low, high = rule.least_rows, rule.most_rows
    with torch.inference_mode(), fast_paths(skinny_linears=False):  # a few rows: else the skinny kernel's
        cases = [(low - 1, False), (low, True), (64, True), (300, high is None)]
        if high is not None:
            cases += [(high, True), (high + 1, False)]
        for rows, takes in cases:
            if rows < 1:
                continue
            x = torch.randn(rows, width)
            assert packs(x, layer.weight) == takes, rows
            got = layer(x)
            want = F.linear(x, layer.weight, layer.bias)
            if takes:
                assert "_packed" in layer.__dict__
                torch.testing.assert_close(got, want)  # fp32 rounding (another summation order: not bit-equal)
            else:
                assert torch.equal(got, want)
        narrower = Linear(width - 8, out, bias=bias)  # fewer multiply-adds than the least, at the fewest rows
        assert not packs(torch.randn(low, width - 8), narrower.weight)
        x = torch.randn(64, width)
        with fast_paths(packed_fp32=False):
            assert not packs(x, layer.weight)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        with fast_paths(packed_linears=False):  # the bf16 switch leaves fp32 alone
            assert packs(x, layer.weight)
        assert not packs(torch.randn(64, 8), torch.randn(8, 8))  # too few multiply-adds


@pytest.mark.parametrize(
    ("cpuinfo", "vendor", "rule"),
    [
        ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: avx512f\n", "GenuineIntel", packed.MKL_FULL_WIDTH),
        ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n", "AuthenticAMD", packed.MKL_NARROW),
        ("processor\t: 0\nCPU implementer\t: 0x41\n", None, packed.MKL_FULL_WIDTH),  # aarch64 names no vendor_id
        ("", None, packed.MKL_FULL_WIDTH),
    ],
)
def test_the_fp32_rule_follows_the_cpu_vendor(cpuinfo: str, vendor: str | None, rule: packed.Fp32Packing) -> None:
    assert field(cpuinfo, "vendor_id") == vendor
    assert packed.packing_for(vendor) == rule


@needs_onednn_fp32
def test_packed_fp32_weight_follows_a_reload() -> None:
    torch.manual_seed(0)
    layer = Linear(512, 1024, bias=False)
    x = torch.randn(16, 512)
    with torch.inference_mode():
        layer(x)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(1024, 512) / 512**0.5)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))  # fp32 rounding


def test_a_call_recording_gradients_stays_plain() -> None:
    layer = Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert not packs(x, layer.weight)  # the weight requires grad, grad mode is on
    layer(x).sum().backward()
    assert layer.weight.grad is not None


@needs_onednn
@pytest.mark.parametrize(
    "name", ["tiny-gemma3", "tiny-qwen3-next", "tiny-gpt-oss", "tiny-kimi-linear", "tiny-nemotron-h"]
)
def test_bf16_engine_tokens_equal_with_and_without_packing(name: str) -> None:
    with quiet_transformers():
        model, config = build_random(name)
    engine = Engine(config, model, EngineConfig(gpu_memory="64MiB", dtype=torch.bfloat16, chunk_size=16))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 19, 40)]
    with fast_paths(packed_linears=False):
        plain = [o.output_ids for o in engine.generate(prompts, 12, stop_at_eos=False)]
    engine.clear_cache()
    got = [o.output_ids for o in engine.generate(prompts, 12, stop_at_eos=False)]
    assert got == plain


@needs_onednn
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_packed_experts_match_grouped_mm(layout: str) -> None:
    from hybridkv.engine.layers.linear import expert_weights
    from hybridkv.engine.layers.routing import Routing

    torch.manual_seed(0)
    experts, hidden, out = 4, 32, 48
    owner = torch.nn.Module()
    stored = torch.randn(experts, out, hidden) if layout == "out_in" else torch.randn(experts, hidden, out)
    stored = stored.to(torch.bfloat16)
    as_out_in = stored if layout == "out_in" else stored.transpose(1, 2)
    x = torch.randn(9, hidden, dtype=torch.bfloat16)
    index = torch.tensor([[0, 2], [2, 3], [0, 3], [2, 0], [3, 2], [0, 2], [2, 3], [3, 0], [0, 2]])  # expert 1: none
    route = Routing.of(index, torch.full((9, 2), 0.5, dtype=torch.bfloat16), experts)
    rows = route.gather(x)
    with torch.inference_mode():
        packed = expert_weights(rows, as_out_in, owner, "_packed")
        assert packed is not None and len(packed.packed) == experts and packed.plain is as_out_in
        got = route.matmul(rows, as_out_in.transpose(1, 2), packed=packed)
        want = route.matmul(rows, as_out_in.transpose(1, 2))
        with fast_paths(packed_linears=False):
            assert expert_weights(rows, as_out_in, owner, "_packed") is None
    torch.testing.assert_close(got, want)
    assert expert_weights(rows.float(), as_out_in.float(), owner, "_packed32") is None


@needs_onednn_fp32
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3-next"])
def test_fp32_engine_through_packed_linears_matches_transformers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # widened x8 (hidden 512, MLP 1024): 8 rows and up clear FP32_MACS, so prefills and 8-row decodes are packed
    with quiet_transformers():
        model, config = build_random(name, 8)
    made: list[torch.Size] = []
    pack = packed._pack
    monkeypatch.setattr(packed, "_pack", lambda w: made.append(w.shape) or pack(w))
    engine = Engine(config, model, EngineConfig(gpu_memory="256MiB", dtype=torch.float32, chunk_size=64))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 13, 17, 21, 25, 29, 33)]
    got = [o.output_ids for o in engine.generate(prompts, 10, stop_at_eos=False)]
    assert made, "no fp32 projection took the packed path"
    with torch.no_grad():
        for ids, tokens in zip(prompts, got, strict=True):
            want = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids) :].tolist()
            assert tokens[: len(want)] == want  # generate stops at EOS; the engine decodes past it
