"""The causal conv1d decode on windows in the pool by cell (``ops.conv_cells``) against the gathered torch path."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.ops import causal_conv1d_decode, causal_conv1d_prefill
from hybridkv.engine.ops.conv_cells import causal_conv1d_decode_cells, causal_conv1d_prefill_cells, convs_in_pool
from hybridkv.engine.ops.native import native

pytestmark = pytest.mark.skipif(native() is None, reason="the C++ kernels cannot be built here")

CELLS, SPARE = 7, 10  # pool cells; entries of other state around each cell's windows


@pytest.mark.parametrize(
    ("dtype", "activation"), [(torch.float32, "silu"), (torch.bfloat16, "silu"), (torch.bfloat16, None)]
)
def test_the_kernel_shifts_only_its_cells_windows_as_the_torch_path_does(
    dtype: torch.dtype, activation: str | None
) -> None:
    gen = torch.Generator().manual_seed(3)
    rows, channels, kernel = 3, 40, 4
    raw = torch.randn(CELLS, SPARE + channels * (kernel - 1) + SPARE, generator=gen).to(dtype)
    pool = raw[:, SPARE:-SPARE].view(CELLS, channels, kernel - 1)
    x = torch.randn(rows, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    cells = torch.tensor([4, 0, 6])
    before = raw.clone()
    want, want_window = causal_conv1d_decode(x, pool.index_select(0, cells), weight, None, activation)
    assert convs_in_pool(x, pool, activation)
    out = causal_conv1d_decode_cells(x, weight, pool, cells, activation)
    assert out.dtype == dtype
    # fp32 taps either way: within fp32 rounding, then (bf16) one rounding of the output (at most one bf16 step)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(pool.index_select(0, cells), want_window)  # the window moves by one input, exactly
    assert torch.equal(pool[cells, :, -1], x)
    others = [c for c in range(CELLS) if c not in cells.tolist()]
    assert torch.equal(raw[others], before[others])
    assert torch.equal(raw[:, :SPARE], before[:, :SPARE]) and torch.equal(raw[:, -SPARE:], before[:, -SPARE:])


@pytest.mark.parametrize(
    ("dtype", "activation"), [(torch.float32, "silu"), (torch.bfloat16, "silu"), (torch.float32, None)]
)
def test_the_prefill_kernel_continues_and_moves_only_its_cells_windows_as_the_torch_path_does(
    dtype: torch.dtype, activation: str | None
) -> None:
    gen = torch.Generator().manual_seed(5)
    channels, kernel, width = 24, 4, 9
    lengths = torch.tensor([9, 1, 2, 6])  # shorter than the window: part of the old window stays
    raw = torch.randn(CELLS, SPARE + channels * (kernel - 1) + SPARE, generator=gen).to(dtype)
    pool = raw[:, SPARE:-SPARE].view(CELLS, channels, kernel - 1)
    x = torch.randn(len(lengths), width, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    cells = torch.tensor([2, 6, 0, 3])
    before = raw.clone()
    want, want_window = causal_conv1d_prefill(x, pool.index_select(0, cells), weight, None, activation, lengths)
    out = causal_conv1d_prefill_cells(x, weight, pool, cells, lengths, activation)
    valid = torch.arange(width)[None, :] < lengths[:, None]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[valid].float(), want[valid].float(), atol=tol, rtol=tol)
    assert torch.equal(pool.index_select(0, cells), want_window)
    others = [c for c in range(CELLS) if c not in cells.tolist()]
    assert torch.equal(raw[others], before[others])
    assert torch.equal(raw[:, :SPARE], before[:, :SPARE]) and torch.equal(raw[:, -SPARE:], before[:, -SPARE:])


def test_it_is_off_with_its_switch_or_for_what_it_cannot_take() -> None:
    pool = torch.zeros(CELLS, 8, 3)
    x = torch.zeros(2, 8)
    assert convs_in_pool(x, pool, "silu")
    with fast_paths(state_cells=False):
        assert not convs_in_pool(x, pool, "silu")
    assert not convs_in_pool(x, pool, "gelu")
    assert not convs_in_pool(x.bfloat16(), pool, "silu")  # windows of another dtype
    assert not convs_in_pool(x, pool.transpose(1, 2).contiguous().transpose(1, 2), None)
