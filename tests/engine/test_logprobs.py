"""Log-probabilities of the chosen tokens (``SamplingParams.logprobs``) equal ``transformers``' log-softmax.

The oracle: the HF model's full forward over prompt + output; the logits at the position before each output
token give its log-probability and the most likely tokens. Requests that do not ask get none, and their
tokens are the same as without a neighbour that asks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import build_random
from hybridkv.engine.request import RequestError, SamplingParams
from tests.engine.harness import hf_model, prompt

PROMPTS = [prompt(40 + i, 7 + 11 * i) for i in range(4)]
NEW = 6


def _engine(name: str) -> Engine:
    weights, config = build_random(name)
    return Engine(config, weights, gpu_memory="16MiB", page_size=4, chunk_size=8)


def _oracle(name: str, ids: list[int], output: list[int]) -> torch.Tensor:
    """HF log-softmax at the positions that chose each output token: ``(len(output), vocab)``."""
    with torch.no_grad():
        logits = hf_model(name)(torch.tensor([ids + output])).logits[0].float()
    return torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + len(output)], dim=-1)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-gemma3", "tiny-nemotron-h"])
def test_chosen_and_top_logprobs_equal_transformers(name: str) -> None:
    engine = _engine(name)
    params: list[Any] = [
        SamplingParams(NEW, logprobs=5),
        SamplingParams(NEW, temperature=0.9, seed=3, logprobs=0),  # sampled: still the raw distribution
        SamplingParams(NEW),  # does not ask
        SamplingParams(NEW, logprobs=20),
    ]
    outs = engine.generate(PROMPTS, params)
    assert outs[2].logprobs is None
    for ids, p, out in zip(PROMPTS, params, outs, strict=True):
        if p.logprobs is None:
            continue
        assert out.logprobs is not None and len(out.logprobs) == len(out.output_ids) > 0
        oracle = _oracle(name, ids, out.output_ids)
        for k, (token, lp) in enumerate(zip(out.output_ids, out.logprobs, strict=True)):
            assert lp.token == token
            assert lp.logprob == pytest.approx(float(oracle[k, token]), abs=1e-4)
            assert len(lp.top) == p.logprobs
            top = torch.topk(oracle[k], p.logprobs)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
            if p.greedy and p.logprobs:
                assert lp.top[0][0] == token  # greedy: the chosen token is the most likely


def test_asking_changes_no_tokens_and_steps_report_each_logprob() -> None:
    plain = _engine("tiny-qwen3-next").generate(PROMPTS, NEW)
    engine = _engine("tiny-qwen3-next")
    rids = [engine.submit(p, SamplingParams(NEW, logprobs=2 if i % 2 else None)) for i, p in enumerate(PROMPTS)]
    streamed: dict[Any, list[float]] = {rid: [] for rid in rids}
    ended = {}
    while engine.has_work():
        step = engine.step()
        for rid, lp in step.logprobs.items():
            streamed[rid].append(lp.logprob)
        ended.update({o.rid: o for o in step.finished})
    for i, rid in enumerate(rids):
        assert ended[rid].output_ids == plain[i].output_ids
        if i % 2:
            assert streamed[rid] == [lp.logprob for lp in ended[rid].logprobs or []]
        else:
            assert streamed[rid] == [] and ended[rid].logprobs is None


@pytest.mark.parametrize("bad", [-1, 21, True, 2.5, "3"])
def test_bad_logprobs_are_refused_naming_the_field(bad: Any) -> None:
    with pytest.raises(RequestError) as err:
        SamplingParams(4, logprobs=bad)
    assert err.value.field == "logprobs"
