"""The skinny linear (``ops.skinny_linear``): ``x @ weight.T (+ bias)`` for one to four rows, each output within
fp32's summation error of the exact dot product, rounded once to the dtype; any weight whose rows are contiguous
(an expert of a stacked tensor); misuse refused with both sides named; taken by ``linear.linear`` and the routed
experts for a decode's few rows, within the dtype's rounding of the library's result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.layers.linear import Linear, linear
from hybridkv.engine.ops.native import native
from hybridkv.engine.ops.skinny_linear import SKINNY_ROWS, skinny_linear, skinny_takes

DTYPES = (torch.bfloat16, torch.float32)


def _kernels() -> None:
    if native() is None:
        pytest.skip("no C++ compiler here: the library's linear serves")


def _beyond_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """How far ``got`` lies outside fp32's summation error of the fp64 result (K / 16 + 8 roundings of the absolute
    products' sum: 16 lanes, then their tree) plus, in bf16, one rounding of the result; inf for a wrong shape. At
    most 0 when ``got`` is right."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    if got.shape != exact.shape:
        return float("inf")
    magnitude = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    bound = (x.shape[-1] / 16 + 8) * torch.finfo(torch.float32).eps * magnitude
    if got.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8  # half an ulp of bf16's 8-bit mantissa
    return float((got.double() - exact).abs().sub(bound).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_every_row_count_and_tail_is_the_exact_dot_within_rounding(dtype: torch.dtype, rows: int) -> None:
    _kernels()
    g = torch.Generator().manual_seed(rows)
    for k in (1, 15, 16, 17, 31, 32, 33, 100, 512):  # the vector tails: fp32 steps 16, bf16 32
        for n in (1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 67):  # the blocks' tails: 4 weight rows, one x row's 8 or 16
            x = torch.randn(rows, k, generator=g).to(dtype)
            w = torch.randn(n, k, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype)
            assert _beyond_rounding(skinny_linear(x, w), x, w, None) <= 0.0, (k, n)
            assert _beyond_rounding(skinny_linear(x, w, b), x, w, b) <= 0.0, (k, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_with_a_row_stride_of_its_own_and_a_batched_x(dtype: torch.dtype) -> None:
    _kernels()
    g = torch.Generator().manual_seed(7)
    stacked = torch.randn(3, 40, 96, generator=g).to(dtype)  # experts (E, out, in): expert 1 is a strided view
    x = torch.randn(2, 1, 96, generator=g).to(dtype)  # (..., K): leading dims kept
    got = skinny_linear(x, stacked[1, ::2])  # every other row: row stride 192
    assert got.shape == (2, 1, 20)
    assert _beyond_rounding(got.view(2, 20), x.view(2, 96), stacked[1, ::2], None) <= 0.0


@pytest.mark.parametrize(("rows", "dtype"), [(2, torch.bfloat16), (1, torch.bfloat16), (1, torch.float32)])
def test_large_logits_split_among_threads_equal_one_thread(rows: int, dtype: torch.dtype) -> None:
    _kernels()
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(rows, 512, generator=g).to(dtype), torch.randn(5003, 512, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = skinny_linear(x, w)
        torch.set_num_threads(2)
        two = skinny_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output is one thread's dot product: the split changes no sum
    assert _beyond_rounding(one, x, w, None) <= 0.0


def test_misuse_is_refused_naming_both_sides() -> None:
    _kernels()
    ops = native()
    assert ops is not None
    x, w = torch.randn(1, 64), torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="1 to 4 rows, got 5"):
        ops.skinny_linear(torch.randn(5, 64), w, None)
    with pytest.raises(RuntimeError, match="x's 63 columns against the weight's 64"):
        ops.skinny_linear(torch.randn(1, 63), w, None)
    with pytest.raises(RuntimeError, match="both bf16 or both fp32, got BFloat16 and Float"):
        ops.skinny_linear(x.bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="each weight row contiguous"):
        ops.skinny_linear(x, torch.randn(64, 8).t(), None)
    with pytest.raises(RuntimeError, match=r"bias a contiguous \(8,\) Float tensor, got Float \[7\]"):
        ops.skinny_linear(x, w, torch.randn(7))
    with pytest.raises(RuntimeError, match="x contiguous"):
        ops.skinny_linear(torch.randn(64, 2).t(), w, None)


def test_taken_only_for_a_few_rows_of_a_matching_dtype_on_the_cpu() -> None:
    _kernels()
    w = torch.randn(8, 64)
    for dtype, most in SKINNY_ROWS.items():
        assert skinny_takes(torch.randn(most, 64).to(dtype), w.to(dtype))
        assert not skinny_takes(torch.randn(most + 1, 64).to(dtype), w.to(dtype))
        assert skinny_takes(torch.randn(1, 1, 64).to(dtype), w.to(dtype))  # rows counted over the leading dims
    assert not skinny_takes(torch.randn(1, 64).bfloat16(), w)  # weight of another dtype
    assert not skinny_takes(torch.randn(1, 64).half(), w.half())  # fp16: the library's
    assert not skinny_takes(torch.randn(1, 64), torch.randn(64, 8).t())  # rows not contiguous
    assert not skinny_takes(torch.randn(1, 64), w, torch.randn(8).bfloat16())  # bias of another dtype
    assert not skinny_takes(torch.randn(0, 64), w)
    with fast_paths(skinny_linears=False):
        assert not skinny_takes(torch.randn(1, 64), w)
    with fast_paths(native_kernels=False):
        assert not skinny_takes(torch.randn(1, 64), w)
    weight = torch.randn(8, 64, requires_grad=True)
    assert not skinny_takes(torch.randn(1, 64), weight)  # a gradient recorded: autograd's path
    with torch.no_grad():
        assert skinny_takes(torch.randn(1, 64), weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_takes_it_for_a_decode_and_agrees_with_the_library(dtype: torch.dtype) -> None:
    _kernels()
    torch.manual_seed(0)
    layer = Linear(512, 1000, bias=True).to(dtype)
    x = torch.randn(1, 1, 512).to(dtype)
    with torch.no_grad():
        fast = layer(x)
        with fast_paths(skinny_linears=False):
            library = layer(x)
        logits = linear(x, layer.weight, None, layer, "_logits")
    assert fast.shape == library.shape == (1, 1, 1000)
    tolerance = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    scale = float(library.float().abs().max())
    assert float((fast.float() - library.float()).abs().max()) <= tolerance * scale
    assert _beyond_rounding(fast.view(1, 1000), x.view(1, 512), layer.weight.detach(), layer.bias.detach()) <= 0.0
    assert _beyond_rounding(logits.view(1, 1000), x.view(1, 512), layer.weight.detach(), None) <= 0.0
