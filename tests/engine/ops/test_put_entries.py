"""The entry-putting kernel (``ops.put_entries``): bit-equal to the indexed stores it replaces, into a strided grid and
a step buffer, at page boundaries and the padding cell, for any source row stride; bad indices refused unwritten."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.forward import pool_io
from hybridkv.engine.ops.native import native
from hybridkv.engine.ops.put_entries import put_columns, put_pages, puts_entries
from tests.engine.harness import hf_model, prompt

PAGE, KV, D = 4, 2, 8


def _needs_kernels() -> None:
    if native() is None:
        pytest.skip("no C++ compiler here: entries take the indexed stores")


def _grid(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A strided grid (cells, 5 slots, page, KV, D): every cell holds one more slot than the pool's (an arena's)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(12, 6, PAGE, KV, D, generator=g).to(dtype)[:, 1:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slots", [slice(0, 2), slice(3, 5), slice(2, 3)])
def test_put_pages_is_the_indexed_store(dtype: torch.dtype, slots: slice) -> None:
    _needs_kernels()
    g = torch.Generator().manual_seed(1)
    t, width = 9, slots.stop - slots.start
    # tokens across page boundaries (offsets 3 then 0 of the next cell), one into the padding cell 0
    cell = torch.tensor([3, 3, 4, 4, 0, 7, 7, 11, 5])
    offset = torch.tensor([2, 3, 0, 1, 0, 3, 2, 0, 1])
    # each slot's entries as a view with a row stride of its own (queries and keys side by side, as qk_rope gives)
    wide = torch.randn(t, 3 + width * KV, D, generator=g).to(dtype)
    new = [wide[:, 3 + s * KV : 3 + (s + 1) * KV] for s in range(width)]
    want, got = _grid(dtype, 0), _grid(dtype, 0)
    want[:, slots].movedim(1, 2).index_put_((cell, offset), torch.stack(new, 1))
    assert puts_entries(got, new)
    put_pages(got, slots, new, cell, offset)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # bit-equal: NaNs and -0 included
    assert torch.equal(got.view(bits), want.view(bits))


def test_put_columns_is_the_indexed_copy() -> None:
    _needs_kernels()
    g = torch.Generator().manual_seed(2)
    buffer = torch.randn(4, 20, KV, D, generator=g).bfloat16()
    cols = torch.tensor([0, 5, 6, 19, 7])
    new = [torch.randn(5, KV, D, generator=g).bfloat16() for _ in range(2)]
    want = buffer.clone()
    want[1:3].index_copy_(1, cols, torch.stack(new))
    put_columns(buffer, slice(1, 3), new, cols)
    assert torch.equal(buffer, want)


def test_no_tokens_write_nothing() -> None:
    _needs_kernels()
    grid, before = _grid(torch.bfloat16, 3), _grid(torch.bfloat16, 3)
    empty = torch.zeros(0, dtype=torch.long)
    put_pages(grid, slice(0, 2), [torch.zeros(0, KV, D, dtype=torch.bfloat16)] * 2, empty, empty)
    assert torch.equal(grid, before)


def test_bad_indices_are_refused_before_any_write() -> None:
    _needs_kernels()
    grid, before = _grid(torch.bfloat16, 4), _grid(torch.bfloat16, 4)
    new = [torch.ones(2, KV, D, dtype=torch.bfloat16)]
    with pytest.raises(RuntimeError, match="offset 4 is outside dst's 4"):
        put_pages(grid, slice(1, 2), new, torch.tensor([1, 2]), torch.tensor([0, PAGE]))
    with pytest.raises(RuntimeError, match="index 12 is outside dst's 12"):
        put_pages(grid, slice(1, 2), new, torch.tensor([1, 12]), torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match=r"slots \[5, 6\) are outside"):
        put_pages(grid, slice(5, 6), new, torch.tensor([1, 2]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="2 new tensors for the 1 slots"):
        put_pages(grid, slice(1, 2), new * 2, torch.tensor([1, 2]), torch.tensor([0, 0]))
    assert torch.equal(grid, before)


def test_other_dtypes_and_the_switch_take_the_torch_path() -> None:
    grid = _grid(torch.bfloat16, 5)
    assert not puts_entries(grid, [torch.zeros(1, KV, D)])  # fp32 entries for a bf16 pool: cast on the torch path
    with fast_paths(put_entries=False):
        assert not puts_entries(grid, [torch.zeros(1, KV, D, dtype=torch.bfloat16)])


@pytest.mark.parametrize("share", [pool_io.WORKSPACE_SHARE, 0.0])  # the whole pool gathered, or a layer at a time
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-kimi-linear"])  # windows and full layers; an MLA latent
def test_a_bf16_engine_serves_the_same_tokens_with_and_without_the_kernel(
    name: str, share: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    _needs_kernels()
    monkeypatch.setattr(pool_io, "WORKSPACE_SHARE", share)
    hf = hf_model(name)
    prompts = [prompt(300 + i, 2 + 5 * i) for i in range(6)]  # decodes, prefills and later chunks in one step
    outs = []
    for on in (False, True):
        config = EngineConfig(gpu_memory=400_000, page_size=4, chunk_size=7, max_context=96, dtype=torch.bfloat16)
        engine = Engine(hf.config, hf, config)
        with fast_paths(put_entries=on):
            outs.append([o.output_ids for o in engine.generate(prompts, 9)])
        engine.mem.verify()
    assert outs[0] == outs[1]
