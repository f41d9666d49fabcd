"""Kimi delta attention vs transformers' chunk_kimi_delta_attention / recurrent_kimi_delta_attention."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)

from hybridkv.engine.ops import delta_step, kda_decode, kda_prefill

from .chunking import assert_close, pad_ragged, spans, unpad_ragged

# Same budget as the gated delta rule. Measured: 0 vs the reference; 1e-6 (outputs) / 5e-6 (state) between chunkings.
ATOL = 2e-5
HEADS, DK, DV = 3, 8, 6


def _inputs(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(batch, seq, HEADS, DK, generator=gen),
        "k": torch.randn(batch, seq, HEADS, DK, generator=gen),
        "v": torch.randn(batch, seq, HEADS, DV, generator=gen),
        "g": -F.softplus(torch.randn(batch, seq, HEADS, DK, generator=gen)),
        "beta": torch.sigmoid(torch.randn(batch, seq, HEADS, generator=gen)),
    }


def _state(batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, HEADS, DK, DV, generator=torch.Generator().manual_seed(seed))


def _reference(fn: Callable[..., Any], inputs: dict[str, torch.Tensor], state: torch.Tensor | None) -> Any:
    # The reference's kernel wrapper forwards q, k, v only positionally.
    return fn(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        g=inputs["g"],
        beta=inputs["beta"],
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )


@pytest.mark.parametrize("seq", [1, 5, 37, 64, 150])
@pytest.mark.parametrize("fresh", [True, False])
def test_prefill_matches_reference(seq: int, fresh: bool) -> None:
    inputs = _inputs(2, seq, seed=seq)
    state = torch.zeros(2, HEADS, DK, DV) if fresh else _state(2, seed=7)
    out, final = kda_prefill(**inputs, state=state)
    ref_out, ref_final = _reference(chunk_kimi_delta_attention, inputs, None if fresh else state)
    assert_close(out, ref_out, ATOL, "output")
    assert_close(final, ref_final, ATOL, "final state")


@pytest.mark.parametrize("matmul_from", [None, 0], ids=["multiply-sum", "matmul"])
def test_decode_matches_reference(matmul_from: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if matmul_from is not None:  # the row-times-state products as matmuls (a real model's large states)
        monkeypatch.setattr(delta_step, "MATMUL_STATE", matmul_from)
    inputs = _inputs(5, 1, seed=11)
    state = _state(5, seed=12)
    out, new_state = kda_decode(**{name: x[:, 0] for name, x in inputs.items()}, state=state)
    ref_out, ref_state = _reference(recurrent_kimi_delta_attention, inputs, state)
    assert_close(out, ref_out[:, 0], ATOL, "output")
    assert_close(new_state, ref_state, ATOL, "state")


def test_chunked_prefill_and_decode_equal_one_pass() -> None:
    inputs = _inputs(2, 170, seed=21)
    state0 = _state(2, seed=22)
    whole, whole_final = kda_prefill(**inputs, state=state0)
    state = state0
    pieces = []
    for start, end in spans(160):
        out, state = kda_prefill(**{name: x[:, start:end] for name, x in inputs.items()}, state=state)
        pieces.append(out)
    for t in range(160, 170):
        out, state = kda_decode(**{name: x[:, t] for name, x in inputs.items()}, state=state)
        pieces.append(out[:, None])
    assert_close(torch.cat(pieces, dim=1), whole, ATOL, "chunked output")
    assert_close(state, whole_final, ATOL, "chunked final state")


def test_ragged_batch_equals_each_request_alone() -> None:
    lengths = [1, 70, 5, 64]
    total = sum(lengths)
    flat = {name: x[0] for name, x in _inputs(1, total, seed=31).items()}
    states = _state(len(lengths), seed=32)
    lens = torch.tensor(lengths)
    starts = torch.cumsum(lens, 0) - lens
    padded = {name: pad_ragged(x, starts, lens, max(lengths)) for name, x in flat.items()}
    out, finals = kda_prefill(**padded, state=states, lengths=lens)
    flat_out = unpad_ragged(out, lens, total)
    for row, (start, n) in enumerate(zip(starts.tolist(), lengths, strict=True)):
        alone, alone_final = kda_prefill(
            **{name: x[None, start : start + n] for name, x in flat.items()}, state=states[row : row + 1]
        )
        assert_close(flat_out[start : start + n], alone[0], ATOL, f"row {row} output")
        assert_close(finals[row], alone_final[0], ATOL, f"row {row} final state")


def test_state_of_wrong_shape_is_refused() -> None:
    inputs = _inputs(2, 1, seed=41)
    with pytest.raises(ValueError, match=r"expected \(batch, heads, dk, dv\) = \(2, 3, 8, 6\)"):
        kda_decode(**{name: x[:, 0] for name, x in inputs.items()}, state=torch.zeros(2, HEADS, DV, DK))


def test_decode_in_place_is_the_same_update_written_into_the_state() -> None:
    inputs = {name: x[:, 0] for name, x in _inputs(4, 1, seed=31).items()}
    state = _state(4, seed=32)
    out, new_state = kda_decode(**inputs, state=state.clone())
    rows = state.clone()
    got_out, got_state = kda_decode(**inputs, state=rows, in_place=True)
    assert got_state.data_ptr() == rows.data_ptr()
    assert torch.equal(got_out, out) and torch.equal(rows, new_state)
