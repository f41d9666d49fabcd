"""Gated delta rule vs transformers' Qwen3-Next torch_chunk/recurrent_gated_delta_rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from hybridkv.engine.fast_paths import FAST, fast_paths
from hybridkv.engine.ops import delta_step, gated_delta_decode, gated_delta_prefill

from .chunking import assert_close, pad_ragged, spans, unpad_ragged

# fp32 with O(1) inputs and states. Measured max diffs: 0 vs the reference (same ops, one pass
# and one step), 4e-7 (outputs) / 2e-6 (state) between chunkings; 2e-5 leaves room for other
# BLAS orderings and still fails on any wrong gate, scale or state hand-off (those are O(0.1)).
ATOL = 2e-5
HEADS_K, HEADS_V, DK, DV = 2, 4, 16, 8


def _inputs(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(batch, seq, HEADS_K, DK, generator=gen),
        "k": torch.randn(batch, seq, HEADS_K, DK, generator=gen),
        "v": torch.randn(batch, seq, HEADS_V, DV, generator=gen),
        "g": -F.softplus(torch.randn(batch, seq, HEADS_V, generator=gen)),
        "beta": torch.sigmoid(torch.randn(batch, seq, HEADS_V, generator=gen)),
    }


def _state(batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, HEADS_V, DK, DV, generator=torch.Generator().manual_seed(seed))


def _qkv(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    # The reference's kernel wrapper forwards q, k, v only positionally.
    return inputs["q"], inputs["k"], inputs["v"]


def _span(inputs: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    return {name: x[:, start:end] for name, x in inputs.items()}


@pytest.mark.parametrize("seq", [1, 5, 37, 64, 150])
@pytest.mark.parametrize("fresh", [True, False])
def test_prefill_matches_reference(seq: int, fresh: bool) -> None:
    inputs = _inputs(3, seq, seed=seq)
    state = torch.zeros(3, HEADS_V, DK, DV) if fresh else _state(3, seed=7)
    out, final = gated_delta_prefill(**inputs, state=state)
    ref_out, ref_final = torch_chunk_gated_delta_rule(
        *_qkv(inputs),
        g=inputs["g"],
        beta=inputs["beta"],
        initial_state=None if fresh else state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert_close(out, ref_out, ATOL, "output")
    assert_close(final, ref_final, ATOL, "final state")


@pytest.mark.parametrize("matmul_from", [None, 0], ids=["multiply-sum", "matmul"])
def test_decode_matches_reference(matmul_from: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if matmul_from is not None:  # the row-times-state products as matmuls (a real model's large states)
        monkeypatch.setattr(delta_step, "MATMUL_STATE", matmul_from)
    inputs = _inputs(5, 1, seed=11)
    state = _state(5, seed=12)
    out, new_state = gated_delta_decode(**{name: x[:, 0] for name, x in inputs.items()}, state=state)
    ref_out, ref_state = torch_recurrent_gated_delta_rule(
        *_qkv(inputs),
        g=inputs["g"],
        beta=inputs["beta"],
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert_close(out, ref_out[:, 0], ATOL, "output")
    assert_close(new_state, ref_state, ATOL, "state")


def test_chunked_prefill_and_decode_equal_one_pass() -> None:
    inputs = _inputs(2, 170, seed=21)
    state0 = _state(2, seed=22)
    whole, whole_final = gated_delta_prefill(**inputs, state=state0)
    state = state0
    pieces = []
    for start, end in spans(160):
        out, state = gated_delta_prefill(**_span(inputs, start, end), state=state)
        pieces.append(out)
    for t in range(160, 170):
        out, state = gated_delta_decode(**{name: x[:, t] for name, x in inputs.items()}, state=state)
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
    out, finals = gated_delta_prefill(**padded, state=states, lengths=lens)
    flat_out = unpad_ragged(out, lens, total)
    for row, (start, n) in enumerate(zip(starts.tolist(), lengths, strict=True)):
        alone = {name: x[None, start : start + n] for name, x in flat.items()}
        alone_out, alone_final = gated_delta_prefill(**alone, state=states[row : row + 1])
        assert_close(flat_out[start : start + n], alone_out[0], ATOL, f"row {row} output")
        assert_close(finals[row], alone_final[0], ATOL, f"row {row} final state")


def test_state_of_wrong_shape_is_refused() -> None:
    inputs = _inputs(2, 3, seed=41)
    with pytest.raises(ValueError, match=r"expected \(batch, heads_v, dk, dv\) = \(2, 4, 16, 8\)"):
        gated_delta_prefill(**inputs, state=torch.zeros(2, HEADS_K, DK, DV))


@pytest.mark.parametrize("matmul_from", [None, 0], ids=["multiply-sum", "matmul"])
def test_decode_in_place_is_the_same_update_written_into_the_state(
    matmul_from: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if matmul_from is not None:
        monkeypatch.setattr(delta_step, "MATMUL_STATE", matmul_from)
    inputs = {name: x[:, 0] for name, x in _inputs(5, 1, seed=21).items()}
    state = _state(5, seed=22)
    out, new_state = gated_delta_decode(**inputs, state=state.clone())
    rows = state.clone()
    some = {name: x[1:4] for name, x in inputs.items()}
    got_out, got_state = gated_delta_decode(**some, state=rows[1:4], in_place=True)
    assert got_state.data_ptr() == rows[1:4].data_ptr()  # written where it was read
    assert torch.equal(rows[0], state[0]) and torch.equal(rows[4], state[4])  # other rows untouched
    assert torch.equal(got_out, out[1:4])
    assert torch.equal(rows[1:4], new_state[1:4])


def _subnormal(x: torch.Tensor) -> int:
    return int(((x != 0) & (x.abs() < torch.finfo(x.dtype).tiny)).sum())


def test_steep_decays_are_flushed_not_denormal_and_match_the_reference() -> None:
    """Decays as steep as the widened random Qwen3-Next's (log decay down to ~-30 a token): without ``flush_decays``
    the intra-chunk inverse, which chains them, holds denormal floats (the slow multiplies the switch removes); with it
    the results hold none and are still the reference's within fp32 tolerance."""
    inputs = _inputs(2, 96, seed=51)
    inputs["g"] = inputs["g"] * 20.0
    state = _state(2, seed=52)
    seen: dict[bool, int] = {}
    solve = torch.linalg.solve_triangular

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        solved = solve(*args, **kwargs)  # type: ignore[arg-type]
        seen[FAST.flush_decays] = seen.get(FAST.flush_decays, 0) + _subnormal(solved)
        return solved

    ref_out, ref_final = torch_chunk_gated_delta_rule(
        *_qkv(inputs),
        g=inputs["g"],
        beta=inputs["beta"],
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    results = {}
    for flush in (False, True):
        with fast_paths(flush_decays=flush), pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.linalg, "solve_triangular", counting)
            results[flush] = gated_delta_prefill(**inputs, state=state, chunk_size=32)
    assert seen[False] > 0  # the unflushed solve makes denormal decayed keys on these inputs
    out, final = results[True]
    assert _subnormal(out) == 0 and _subnormal(final) == 0
    assert_close(out, ref_out, ATOL, "flushed output")
    assert_close(final, ref_final, ATOL, "flushed final state")
    assert_close(out, results[False][0], ATOL, "flushed vs unflushed output")
