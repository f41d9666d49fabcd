"""Mamba2 SSD scan vs transformers' Nemotron-H mamba2_chunk_scan / mamba2_selective_state_update."""

from __future__ import annotations

import pytest
import torch
from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan, mamba2_selective_state_update

from hybridkv.engine.ops import ssd_decode, ssd_prefill

from .chunking import assert_close, pad_ragged, spans, unpad_ragged

# fp32, O(1) inputs. Measured: 0 vs the reference scan, 5e-7 vs its decode step, 4e-6 between chunkings.
ATOL = 2e-5
HEADS, HEAD_DIM, GROUPS, STATE = 4, 5, 2, 6
CHUNK = 16
DT_LIMIT = (0.001, float("inf"))


def _params(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "A": -torch.exp(torch.randn(HEADS, generator=gen)),
        "D": torch.randn(HEADS, generator=gen),
        "dt_bias": torch.randn(HEADS, generator=gen),
    }


def _inputs(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, seq, HEADS, HEAD_DIM, generator=gen),
        "dt": torch.randn(batch, seq, HEADS, generator=gen),
        "B": torch.randn(batch, seq, GROUPS, STATE, generator=gen),
        "C": torch.randn(batch, seq, GROUPS, STATE, generator=gen),
    }


def _state(batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, HEADS, HEAD_DIM, STATE, generator=torch.Generator().manual_seed(seed))


def _at(inputs: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    return {name: x[:, t] for name, x in inputs.items()}


@pytest.mark.parametrize("seq", [1, 5, 13, 16, 50])
@pytest.mark.parametrize("fresh", [True, False])
def test_prefill_matches_reference(seq: int, fresh: bool) -> None:
    inputs, params = _inputs(3, seq, seed=seq), _params(1)
    state = torch.zeros(3, HEADS, HEAD_DIM, STATE) if fresh else _state(3, seed=7)
    y, final = ssd_prefill(**inputs, **params, state=state, chunk_size=CHUNK, dt_limit=DT_LIMIT)
    ref_y, ref_final = mamba2_chunk_scan(
        inputs["x"],
        inputs["dt"],
        params["A"],
        inputs["B"],
        inputs["C"],
        CHUNK,
        D=params["D"],
        dt_bias=params["dt_bias"],
        initial_states=None if fresh else state,
        dt_softplus=True,
        dt_limit=DT_LIMIT,
        return_final_states=True,
    )
    assert_close(y, ref_y, ATOL, "output")
    assert_close(final, ref_final, ATOL, "final state")


def test_decode_matches_reference() -> None:
    inputs, params = _at(_inputs(4, 1, seed=11), 0), _params(2)
    state = _state(4, seed=12)
    ref_state = state.clone()
    y, new_state = ssd_decode(**inputs, **params, state=state)
    assert new_state is state  # updated in place, as the reference does
    # The reference takes per-(head, channel) parameters and updates the state in place.
    ref_y = mamba2_selective_state_update(
        ref_state,
        inputs["x"],
        inputs["dt"][..., None].expand(-1, -1, HEAD_DIM),
        params["A"][:, None, None].expand(-1, HEAD_DIM, STATE),
        inputs["B"],
        inputs["C"],
        params["D"][:, None].expand(-1, HEAD_DIM),
        dt_bias=params["dt_bias"][:, None].expand(-1, HEAD_DIM),
        dt_softplus=True,
    )
    assert_close(y, ref_y, ATOL, "output")
    assert_close(new_state, ref_state, ATOL, "state")


def test_chunked_prefill_and_decode_equal_one_pass() -> None:
    # dt_limit off: the reference's decode step never clamps dt, so a prefill-vs-decode comparison needs no clamp.
    inputs, params = _inputs(2, 170, seed=21), _params(3)
    state0 = _state(2, seed=22)
    whole, whole_final = ssd_prefill(**inputs, **params, state=state0, chunk_size=CHUNK)
    state = state0
    pieces = []
    for start, end in spans(160):
        span = {name: x[:, start:end] for name, x in inputs.items()}
        y, state = ssd_prefill(**span, **params, state=state, chunk_size=CHUNK)
        pieces.append(y)
    for t in range(160, 170):
        y, state = ssd_decode(**_at(inputs, t), **params, state=state)
        pieces.append(y[:, None])
    assert_close(torch.cat(pieces, dim=1), whole, ATOL, "chunked output")
    assert_close(state, whole_final, ATOL, "chunked final state")


def test_ragged_batch_equals_each_request_alone() -> None:
    lengths = [1, 40, 5, 16]
    total = sum(lengths)
    flat = {name: x[0] for name, x in _inputs(1, total, seed=31).items()}
    params = _params(4)
    states = _state(len(lengths), seed=32)
    lens = torch.tensor(lengths)
    starts = torch.cumsum(lens, 0) - lens
    padded = {name: pad_ragged(x, starts, lens, max(lengths)) for name, x in flat.items()}
    y, finals = ssd_prefill(**padded, **params, state=states, chunk_size=CHUNK, dt_limit=DT_LIMIT, lengths=lens)
    flat_y = unpad_ragged(y, lens, total)
    for row, (start, n) in enumerate(zip(starts.tolist(), lengths, strict=True)):
        alone = {name: x[None, start : start + n] for name, x in flat.items()}
        alone_y, alone_final = ssd_prefill(
            **alone, **params, state=states[row : row + 1], chunk_size=CHUNK, dt_limit=DT_LIMIT
        )
        assert_close(flat_y[start : start + n], alone_y[0], ATOL, f"row {row} output")
        assert_close(finals[row], alone_final[0], ATOL, f"row {row} final state")


def test_state_of_wrong_shape_is_refused() -> None:
    inputs, params = _inputs(2, 3, seed=41), _params(5)
    with pytest.raises(ValueError, match=r"expected \(batch, heads, head_dim, state_size\) = \(2, 4, 5, 6\)"):
        ssd_prefill(**inputs, **params, state=torch.zeros(2, HEADS, STATE, HEAD_DIM), chunk_size=CHUNK)
