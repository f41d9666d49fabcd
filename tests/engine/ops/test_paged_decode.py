"""Paged decode attention (``ops.paged_decode``): each row's visible columns read from its pages; in bf16 as close to
the fp32 result as torch's bf16 attention over a gathered copy is, in fp32 as close to the fp64 result as torch's fp32
attention is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.ops.native import native
from hybridkv.engine.ops.paged_decode import PagedRows, paged_decode

PAGE, KV, HEADS, D = 4, 2, 4, 16


def _case(seed: int, dtype: torch.dtype = torch.bfloat16, d: int = D) -> tuple[torch.Tensor, torch.Tensor, PagedRows]:
    g = torch.Generator().manual_seed(seed)
    cells, slots, rows, width = 40, 6, 5, 7
    # a strided grid: every cell holds more than this pool's slots (as an arena's cells do)
    arena = torch.randn(cells, slots + 1, PAGE, KV, d, generator=g).to(dtype)
    grid = arena[:, 1:]
    q = torch.randn(rows, HEADS, d, generator=g).to(dtype)
    table = torch.randperm(cells - 1, generator=g)[: rows * width].view(rows, width) + 1
    stop = torch.randint(1, width * PAGE + 1, (rows,), generator=g)
    start = (stop - torch.randint(1, 12, (rows,), generator=g)).clamp(min=0)  # a window, or the whole history
    start[0] = 0
    zeros, q_begin = torch.zeros(rows, dtype=torch.long), torch.arange(rows + 1)
    return q, grid, PagedRows(table, start, stop, table[:, 0], zeros, q_begin)


def _reference(q: torch.Tensor, grid: torch.Tensor, slots: slice, p: PagedRows, dtype: torch.dtype) -> torch.Tensor:
    """SDPA over each row's gathered columns, in ``dtype``."""
    outs = []
    for r in range(q.shape[0]):
        cols = torch.arange(int(p.start[r]), int(p.stop[r]))
        cells = p.table[r, cols // PAGE]
        k, v = (grid[cells, s, cols % PAGE].to(dtype).transpose(0, 1) for s in (slots.start, slots.start + 1))
        qr = q[r].to(dtype).unsqueeze(1)  # (heads, 1, D)
        outs.append(F.scaled_dot_product_attention(qr[None], k[None], v[None], scale=0.3, enable_gqa=True)[0, :, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("seed", range(4))
def test_paged_decode_is_as_close_to_fp32_as_bf16_sdpa(seed: int) -> None:
    if native() is None:
        pytest.skip("no C++ compiler here: decodes take the gathered path")
    q, grid, paged = _case(seed)
    slots = slice(2, 4)
    got = paged_decode(q, grid, slots, paged, 0.3).float()
    exact = _reference(q, grid, slots, paged, torch.float32)
    bf16 = _reference(q, grid, slots, paged, torch.bfloat16).float()
    assert (got - exact).abs().max() <= max((bf16 - exact).abs().max(), 2**-8 * exact.abs().max())


@pytest.mark.parametrize("d", [16, 48, 72])  # the 16-lane dots, the 32-output value sums and the scalar tails
def test_fp32_paged_decode_is_as_close_to_fp64_as_fp32_sdpa(d: int) -> None:
    if native() is None:
        pytest.skip("no C++ compiler here: decodes take the gathered path")
    q, grid, paged = _case(d, torch.float32, d)
    slots = slice(2, 4)
    got = paged_decode(q, grid, slots, paged, 0.3)
    assert got.dtype == torch.float32
    exact = _reference(q, grid, slots, paged, torch.float64)
    fp32 = _reference(q, grid, slots, paged, torch.float32).double()
    assert (got.double() - exact).abs().max() <= max(4 * (fp32 - exact).abs().max(), 1e-6 * exact.abs().max())


def test_paged_decode_refuses_queries_of_another_dtype_than_the_pool() -> None:
    if native() is None:
        pytest.skip("no C++ compiler here")
    q, grid, paged = _case(0)
    with pytest.raises(RuntimeError, match="queries of Float over a grid of BFloat16"):
        paged_decode(q.float(), grid, slice(0, 2), paged, 0.3)


def test_paged_decode_refuses_columns_outside_the_table() -> None:
    if native() is None:
        pytest.skip("no C++ compiler here")
    q, grid, paged = _case(0)
    bad = PagedRows(paged.table, paged.start, paged.stop + 100, paged.cell, paged.offset, paged.q_begin)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_decode(q, grid, slice(0, 2), bad, 0.3)
