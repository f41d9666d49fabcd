"""Band attention (``ops.band_attention``): each query over only its visible columns, as close to the fp32 result as
torch's bf16 SDPA over every column is; strided inputs (a step buffer's views, padded queries) read in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.layers import attention
from hybridkv.engine.ops.band_attention import band_attention, bands
from hybridkv.engine.ops.native import native
from tests.engine.harness import hf_model, prompt

HEADS, KV, D = 4, 2, 32


def _needs_kernels() -> None:
    if native() is None:
        pytest.skip("no C++ compiler here: parts take SDPA")


def _window_mask(pre: list[int], ext: list[int], q: int, width: int, window: int) -> torch.Tensor:
    """``(R, 1, q, width)``: row r's padded query i at position pre + min(i, ext - 1) sees keys in (pos - window, pos]
    below the row's length (the engine's ``_masks`` for a window pool, columns from position 0)."""
    masks = []
    for p, e in zip(pre, ext, strict=True):
        pos = p + torch.arange(q).clamp(max=e - 1)[:, None]
        key = torch.arange(width)[None, :]
        visible = (key <= pos) & (key > pos - window) & (key < p + e)
        masks.append(torch.where(visible, 0.0, float("-inf")))
    return torch.stack(masks)[:, None]


def _case(seed: int, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pre, ext, q, width = [0, 5, 17, 3], [12, 7, 1, 12], 12, 32
    # the queries padded as the engine pads them: (R, Q, heads, D) seen as (R, heads, Q, D)
    queries = torch.randn(len(pre), q, HEADS, D, generator=g).bfloat16().transpose(1, 2)
    # keys and values as a step buffer's slots (2 of 3 slots, rows of width columns): strided views
    buffer = torch.randn(3, len(pre) * width, KV, D, generator=g).bfloat16().view(3, len(pre), width, KV, D)
    return queries, buffer[1], buffer[2], _window_mask(pre, ext, q, width, window)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    k, v = (x.to(dtype).transpose(1, 2) for x in (k, v))
    return F.scaled_dot_product_attention(
        q.to(dtype), k, v, attn_mask=mask.to(dtype), scale=0.3, enable_gqa=True
    ).float()


@pytest.mark.parametrize("window", [1, 4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_band_attention_is_as_close_to_fp32_as_bf16_sdpa(seed: int, window: int) -> None:
    _needs_kernels()
    q, k, v, mask = _case(seed, window)
    got = band_attention(q, k, v, mask, 0.3)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    exact, bf16 = _sdpa(q, k, v, mask, torch.float32), _sdpa(q, k, v, mask, torch.bfloat16)
    err = (got.float() - exact).abs().max()
    assert err <= max((bf16 - exact).abs().max(), 2**-8 * exact.abs().max())


def test_columns_masked_inside_the_band_are_left_out() -> None:
    _needs_kernels()
    q, k, v, mask = _case(2, 8)
    g = torch.Generator().manual_seed(5)
    holes = (torch.rand(mask.shape, generator=g) < 0.3) & (mask == 0)
    holes[..., :, 0] = False  # every query still sees column 0 or its band's ends
    mask = torch.where(holes, float("-inf"), mask)
    seen = (mask == 0).any(-1, keepdim=True)
    mask = torch.where(seen, mask, _case(2, 8)[3])  # a query left seeing nothing keeps its band
    got = band_attention(q, k, v, mask, 0.3).float()
    exact, bf16 = _sdpa(q, k, v, mask, torch.float32), _sdpa(q, k, v, mask, torch.bfloat16)
    assert (got - exact).abs().max() <= max((bf16 - exact).abs().max(), 2**-8 * exact.abs().max())


def test_band_attention_reads_only_the_visible_columns() -> None:
    _needs_kernels()
    q, k, v, mask = _case(0, 4)
    before = band_attention(q, k, v, mask, 0.3)
    hidden = mask.expand(-1, 1, -1, -1).amax(dim=2)[:, 0] == float("-inf")  # (R, W) columns no query sees
    k, v = k.clone(), v.clone()
    k[hidden], v[hidden] = float("nan"), float("nan")  # stale bytes of the padding page may be anything
    assert torch.equal(band_attention(q, k, v, mask, 0.3), before)


def test_a_query_that_sees_nothing_gets_zeros() -> None:
    _needs_kernels()
    q, k, v, mask = _case(1, 4)
    mask = mask.clone()
    mask[2, 0, 5] = float("-inf")
    out = band_attention(q, k, v, mask, 0.3)
    assert torch.equal(out[2, :, 5], torch.zeros_like(out[2, :, 5]))
    assert out[2, :, 4].abs().sum() > 0


def test_wide_windows_fp32_sinks_and_the_switch_take_sdpa() -> None:
    q, k, _, _ = _case(0, 4)
    assert native() is None or bands(q, k, 8, sinks=False)  # 8 of 32 columns
    assert not bands(q, k, 9, sinks=False)  # more than a quarter of the columns
    assert not bands(q, k, None, sinks=False)  # the whole history
    assert not bands(q, k, 4, sinks=True)
    assert not bands(q.float(), k.float(), 4, sinks=False)
    with fast_paths(band_attention=False):
        assert not bands(q, k, 4, sinks=False)


def test_a_bf16_gemma3_engine_takes_the_band_for_its_window_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_kernels()
    calls: list[tuple[int, ...]] = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append(tuple(k.shape))
        return band_attention(q, k, v, mask, scale)

    monkeypatch.setattr(attention, "band_attention", spy)
    hf = hf_model("tiny-gemma3")  # window 8 in its sliding layers
    prompts = [prompt(400 + i, 30 + 9 * i) for i in range(4)]
    outs = []
    for on in (False, True):
        config = EngineConfig(gpu_memory=400_000, page_size=4, chunk_size=64, max_context=128, dtype=torch.bfloat16)
        with fast_paths(band_attention=on):
            outs.append([o.output_ids for o in Engine(hf.config, hf, config).generate(prompts, 6)])
        assert bool(calls) == on
    assert calls and all(0.25 * width >= 8 for _, width, _, _ in calls)
    assert outs[0] == outs[1]  # bf16 rounding apart: the same greedy tokens here
