"""The GatedDeltaNet decode on states in the pool by cell (``ops.gdn_cells``) against the gathered torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.ops import gated_delta_decode
from hybridkv.engine.ops.gdn_cells import decodes_in_pool, gated_delta_decode_cells
from hybridkv.engine.ops.native import native

pytestmark = pytest.mark.skipif(native() is None, reason="the C++ kernels cannot be built here")

CELLS, SPARE = 9, 24  # pool cells; fp32 words of other state around each cell's recurrent state


def _pool(heads: int, dk: int, dv: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A raw ``(CELLS, words)`` pool and its ``(CELLS, heads, dk, dv)`` view of each cell's state (strided cells)."""
    raw = torch.randn(CELLS, SPARE + heads * dk * dv + SPARE, generator=gen)
    return raw, raw[:, SPARE : SPARE + heads * dk * dv].view(CELLS, heads, dk, dv)


@pytest.mark.parametrize(
    ("heads_k", "heads_v", "dk", "dv", "dtype"),
    [(2, 4, 16, 8, torch.float32), (1, 2, 32, 64, torch.bfloat16), (3, 3, 8, 16, torch.float32)],
)
def test_the_kernel_updates_only_its_cells_as_the_torch_path_does(
    heads_k: int, heads_v: int, dk: int, dv: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(heads_v * dk + dv)
    rows = 4
    q = torch.randn(rows, heads_k, dk, generator=gen).to(dtype)
    k = torch.randn(rows, heads_k, dk, generator=gen).to(dtype)
    v = torch.randn(rows, heads_v, dv, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(rows, heads_v, generator=gen))
    beta = torch.sigmoid(torch.randn(rows, heads_v, generator=gen))
    raw, pool = _pool(heads_v, dk, dv, gen)
    cells = torch.tensor([7, 2, 5, 0])
    before = raw.clone()
    want_out, want_state = gated_delta_decode(q, k, v, g, beta, pool.index_select(0, cells))
    assert decodes_in_pool(pool)
    out = gated_delta_decode_cells(q, k, v, g, beta, pool, cells)
    assert out.dtype == dtype and out.shape == (rows, heads_v, dv)
    # fp32: the same products, sums in another order (measured within 5e-7 here); bf16: one rounding of the output
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-5 if dtype == torch.float32 else 1e-2, rtol=0)
    torch.testing.assert_close(pool.index_select(0, cells), want_state, atol=2e-5, rtol=0)
    others = [c for c in range(CELLS) if c not in cells.tolist()]
    assert torch.equal(raw[others], before[others])  # the other cells, untouched
    assert torch.equal(raw[:, :SPARE], before[:, :SPARE]) and torch.equal(raw[:, -SPARE:], before[:, -SPARE:])
    assert not torch.equal(pool.index_select(0, cells), before[:, SPARE:-SPARE].reshape(pool.shape)[cells])


def test_it_is_off_with_its_switch_or_for_a_layout_it_cannot_read() -> None:
    _, pool = _pool(2, 4, 8, torch.Generator().manual_seed(0))
    assert decodes_in_pool(pool)
    with fast_paths(state_cells=False):
        assert not decodes_in_pool(pool)
    with fast_paths(native_kernels=False):
        assert not decodes_in_pool(pool)
    assert not decodes_in_pool(pool.double())
    assert not decodes_in_pool(pool.transpose(2, 3))  # a state not contiguous in its cell


def test_a_cell_outside_the_pool_is_refused_by_name() -> None:
    gen = torch.Generator().manual_seed(1)
    _, pool = _pool(2, 4, 8, gen)
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="cell 9 of row 0 is outside the pool's 9 cells"):
        gated_delta_decode_cells(q, k, v, torch.zeros(1, 2), torch.ones(1, 2), pool, torch.tensor([CELLS]))
