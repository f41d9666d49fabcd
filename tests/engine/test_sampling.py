"""Token choice: greedy, seeded sampling per request (top-k, top-p), never a token from non-finite logits."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.sched import sampling
from hybridkv.engine.sched.request import SamplingParams
from hybridkv.engine.sched.sampling import NON_FINITE, choose_tokens

VOCAB = 50


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("block", [1, 3, sampling.SAMPLE_BLOCK])  # rows drawn one, three, or all at a time
def test_a_rows_draw_depends_only_on_its_logits_params_and_position(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampling, "SAMPLE_BLOCK", block * VOCAB)
    logits = _logits(6, 1)
    params = [
        SamplingParams(4, 1.0, seed=3),
        SamplingParams(4),  # greedy
        SamplingParams(4, 0.7, top_k=5, seed=4),
        SamplingParams(4, 1.3, top_p=0.6, seed=5),
        SamplingParams(4, 1.0, top_k=8, top_p=0.9, seed=6),
        SamplingParams(4, 2.0, seed=3),
    ]
    positions = [10, 11, 12, 13, 14, 10]
    together = choose_tokens(logits, params, positions)
    alone = [
        choose_tokens(logits[i : i + 1], [p], [n])[0] for i, (p, n) in enumerate(zip(params, positions, strict=True))
    ]
    assert together == alone
    assert together[1] == int(logits[1].argmax())
    reversed_rows = choose_tokens(logits.flip(0), params[::-1], positions[::-1])
    assert reversed_rows == together[::-1]


def test_draws_stay_inside_top_k_and_top_p_and_follow_the_softmax() -> None:
    row = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -5.0])
    probs = torch.softmax(row, dim=0)
    positions = list(range(3000))
    top_k = choose_tokens(row.expand(3000, -1), [SamplingParams(4, 1.0, top_k=2, seed=1)] * 3000, positions)
    assert set(top_k) == {0, 1}
    nucleus = choose_tokens(row.expand(3000, -1), [SamplingParams(4, 1.0, top_p=0.7, seed=2)] * 3000, positions)
    assert set(nucleus) == {0, 1}  # p(0) = 0.52 < 0.7 <= p(0) + p(1)
    free = choose_tokens(row.expand(3000, -1), [SamplingParams(4, 1.0, seed=3)] * 3000, positions)
    counts = torch.bincount(torch.tensor(free), minlength=6).float() / 3000
    assert float((counts - probs).abs().max()) < 0.04  # a draw from the softmax (3,000 draws: sd < 0.01)


def test_a_non_finite_row_gets_no_token_and_the_others_still_draw() -> None:
    logits = _logits(3, 2)
    logits[1, 7] = float("nan")
    params = [SamplingParams(4, 1.0, top_p=0.5, seed=1)] * 3
    chosen = choose_tokens(logits, params, [0, 0, 0])
    assert chosen[1] == NON_FINITE and all(0 <= c < VOCAB for c in (chosen[0], chosen[2]))


def test_the_sampled_rows_are_read_off_the_device_once_whatever_the_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # a real vocabulary draws about a row a block: each block reading the device would sync once per sampled row
    monkeypatch.setattr(sampling, "SAMPLE_BLOCK", VOCAB)  # one row a block
    reads: list[tuple[int, ...]] = []
    to_host = torch.Tensor.cpu

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        reads.append(tuple(self.shape))
        return to_host(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    params = [SamplingParams(4, 1.0, top_k=5, seed=i) if i % 4 else SamplingParams(4) for i in range(8)]
    chosen = choose_tokens(_logits(8, 3), params, list(range(8)))
    assert reads == [(6, VOCAB)]  # the six sampled rows at once
    monkeypatch.setattr(sampling, "SAMPLE_BLOCK", 2**18)
    assert choose_tokens(_logits(8, 3), params, list(range(8))) == chosen  # the same draws in one block


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 9e-6])
def test_a_temperature_too_small_to_divide_by_chooses_greedily(temperature: float) -> None:
    # logits / 1e-39 overflow to -inf and +inf: a draw among infinities would pick the first of them, not the argmax
    logits = torch.tensor([[-50.0, -10.0, -3.0, -40.0], [10.0, 50.0, 49.0, -5.0]])
    params = [SamplingParams(4, temperature, seed=7)] * 2
    assert params[0].greedy and choose_tokens(logits, params, [0, 0]) == [2, 1]
    assert not SamplingParams(4, 1e-5).greedy  # from GREEDY_BELOW on, it samples


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_largest_and_refuses_nan_and_infinities(dtype: torch.dtype) -> None:
    logits = torch.randint(0, 3, (6, 4096), generator=torch.Generator().manual_seed(3)).to(dtype)  # many ties
    logits[1, 9], logits[2, 4000], logits[3, 0] = float("nan"), float("inf"), float("-inf")
    chosen = choose_tokens(logits, [SamplingParams(4)] * 6, [0] * 6)
    finite = torch.isfinite(logits).all(dim=-1)
    assert chosen == torch.where(finite, torch.argmax(logits, dim=-1), NON_FINITE).tolist()
    assert chosen[1] == chosen[2] == chosen[3] == NON_FINITE
