"""Paged attention of multi-token rows (``ops.paged_spans``): each query's visible columns (causal, and a window
when the pool keeps one) read from the row's pages; fp32 as close to the fp64 result as torch's fp32 attention is,
bf16 as close to the fp32 one as torch's bf16 attention is; bad plans are refused before any read."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.ops.native import native
from hybridkv.engine.ops.paged_decode import PagedRows
from hybridkv.engine.ops.paged_spans import paged_spans, pages_spans
from hybridkv.spec import FULL_POOL, WindowPool
from tests.spec.test_new_kind import ChunkPool

PAGE, KV = 4, 2

pytestmark = pytest.mark.skipif(native() is None, reason="no C++ compiler here: spans take the gathered path")


def _case(
    seed: int, dtype: torch.dtype, d: int, heads: int, lengths: list[int], window: int | None
) -> tuple[torch.Tensor, torch.Tensor, PagedRows]:
    """Rows of ``lengths`` new tokens each after a random history, their pages scattered over a strided grid (every
    cell holds more than this pool's slots, as an arena's cells do)."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), 100
    cells = rows * width + 1
    grid = torch.randn(cells, 5, PAGE, KV, d, generator=g).to(dtype)[:, 1:]
    table = torch.randperm(cells - 1, generator=g)[: rows * width].view(rows, width) + 1
    ext = torch.tensor(lengths)
    pre = torch.randint(0, 150, (rows,), generator=g)
    seq = pre + ext
    first = (pre + 1 - window).clamp(min=0) if window else torch.zeros_like(pre)
    base = first // PAGE * PAGE  # columns count from the first visible page (as the step plans them)
    q = torch.randn(int(ext.sum()), heads, d, generator=g).to(dtype)
    q_begin = torch.cat((torch.zeros(1, dtype=torch.long), ext.cumsum(0)))
    return q, grid, PagedRows(table, first - base, seq - base, table[:, 0], table[:, 0], q_begin)


def _reference(
    q: torch.Tensor, grid: torch.Tensor, p: PagedRows, window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """Each query alone: SDPA over its visible columns gathered, in ``dtype``."""
    out = torch.empty(q.shape, dtype=dtype)
    for r in range(p.start.numel()):
        a, b = int(p.q_begin[r]), int(p.q_begin[r + 1])
        stop = int(p.stop[r])
        for i in range(b - a):
            col = stop - (b - a) + i
            low = max(int(p.start[r]), col + 1 - window) if window else int(p.start[r])
            cols = torch.arange(low, col + 1)
            cells = p.table[r, cols // PAGE]
            k, v = (grid[cells, s, cols % PAGE].to(dtype).transpose(0, 1) for s in (1, 2))
            qi = q[a + i].to(dtype)[None, :, None]  # (1, heads, 1, D)
            out[a + i] = F.scaled_dot_product_attention(qi, k[None], v[None], scale=0.3, enable_gqa=True)[0, :, 0]
    return out


CASES = [  # (lengths, heads, d, window): tails on a prefix, chunks longer than a task's queries, GQA groups, windows
    ([16, 16, 3], 4, 128, None),
    ([200, 1, 37], 4, 64, None),
    ([70, 9], 8, 80, None),  # 4 query heads a kv head; 80: the 64-output sums and a scalar tail
    ([40, 5, 33], 2, 48, 8),
    ([130, 2], 4, 128, 50),
    ([5, 3], 260, 16, None),  # 130 query heads a kv head: more than a task takes, cut over two tasks
    ([9], 300, 16, 4),
]


@pytest.mark.parametrize(("lengths", "heads", "d", "window"), CASES)
def test_fp32_spans_are_as_close_to_fp64_as_fp32_sdpa(
    lengths: list[int], heads: int, d: int, window: int | None
) -> None:
    q, grid, rows = _case(len(lengths) * d, torch.float32, d, heads, lengths, window)
    got = paged_spans(q, grid, slice(1, 3), rows, window, 0.3).double()
    exact = _reference(q, grid, rows, window, torch.float64)
    fp32 = _reference(q, grid, rows, window, torch.float32).double()
    assert (got - exact).abs().max() <= max(4 * (fp32 - exact).abs().max(), 1e-6)


@pytest.mark.parametrize(("lengths", "heads", "d", "window"), CASES[:2] + CASES[3:4])
def test_bf16_spans_are_as_close_to_fp32_as_bf16_sdpa(
    lengths: list[int], heads: int, d: int, window: int | None
) -> None:
    q, grid, rows = _case(7, torch.bfloat16, d, heads, lengths, window)
    got = paged_spans(q, grid, slice(1, 3), rows, window, 0.3).float()
    exact = _reference(q, grid, rows, window, torch.float32)
    bf16 = _reference(q, grid, rows, window, torch.bfloat16).float()
    assert (got - exact).abs().max() <= max((bf16 - exact).abs().max(), 2**-8 * exact.abs().max())


def test_each_query_sees_only_its_past() -> None:
    """A key changed after a query's column leaves that query's output as it was (and changes a later one's)."""
    q, grid, rows = _case(3, torch.float32, 32, 4, [20], None)
    before = paged_spans(q, grid, slice(1, 3), rows, None, 0.3)
    col = int(rows.stop[0]) - 10  # the 11th-from-last query's column
    grid[rows.table[0, col // PAGE], 1:3, col % PAGE] += 5.0
    after = paged_spans(q, grid, slice(1, 3), rows, None, 0.3)
    assert torch.equal(after[:10], before[:10])
    assert not torch.allclose(after[10:], before[10:])


def _refused(q: torch.Tensor, grid: torch.Tensor, rows: PagedRows, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        paged_spans(q, grid, slice(1, 3), rows, None, 0.3)


def test_bad_plans_are_refused_naming_the_row() -> None:
    q, grid, rows = _case(5, torch.float32, 32, 4, [6, 3], None)
    _refused(q, grid, replace(rows, stop=rows.stop + 10_000), "row 0")
    far = rows.table.clone()
    far[1] = grid.shape[0] + 3
    _refused(q, grid, replace(rows, table=far), "row 1 cell out of range")
    _refused(q, grid, replace(rows, q_begin=rows.q_begin + 1), "q_begin must run from 0")
    late = rows.start.clone()
    late[1] = rows.stop[1] - 1  # its first query's column is before its first visible one
    _refused(q, grid, replace(rows, start=late), "row 1's 3 queries")
    _refused(q.bfloat16(), grid, rows, "cast the queries to the pool's dtype")


def test_only_the_rules_the_kernel_knows_read_spans_from_the_pages() -> None:
    """The whole history and a window (``WindowPool``) do; a pool of another history rule (the spec tests' chunked
    one, Llama 4's) keeps its gathered rows (its masks follow ``first_needed``), and so does a bf16 window pool while
    the band kernel is on."""
    grid = torch.zeros(3, 2, PAGE, KV, 16)
    names = {"k", "v"}
    assert pages_spans(grid, names, False, FULL_POOL) and pages_spans(grid, names, False, WindowPool(8))
    assert not pages_spans(grid, names, False, ChunkPool(8))
    assert not pages_spans(grid, names, True, FULL_POOL)  # attention sinks
    assert not pages_spans(grid.bfloat16(), names, False, WindowPool(8))
    with fast_paths(band_attention=False):
        assert pages_spans(grid.bfloat16(), names, False, WindowPool(8))
    with fast_paths(paged_spans=False):
        assert not pages_spans(grid, names, False, FULL_POOL)
