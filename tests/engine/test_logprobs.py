"""Log-probabilities of the chosen tokens (``SamplingParams.logprobs``) equal ``transformers``' log-softmax.

The oracle: the HF model's full forward over prompt + output; the logits at the position before each output
token give its log-probability and the most likely tokens. Requests that do not ask get none, and their
tokens are the same as without a neighbour that asks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import build_random
from hybridkv.engine.sched.request import RequestError, SamplingParams
from tests.engine.harness import hf_model, prompt

PROMPTS = [prompt(40 + i, 7 + 11 * i) for i in range(4)]
NEW = 6


def _engine(name: str) -> Engine:
    weights, config = build_random(name)
    return Engine(config, weights, EngineConfig(gpu_memory="16MiB", page_size=4, chunk_size=8))


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


def _prompt_oracle(name: str, ids: list[int]) -> torch.Tensor:
    """HF log-softmax at positions 0 .. len - 2 (each gives the next prompt token)."""
    with torch.no_grad():
        logits = hf_model(name)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _check_prompt(name: str, ids: list[int], got: Any, top: int) -> None:
    assert got is not None and len(got) == len(ids) - 1
    oracle = _prompt_oracle(name, ids)
    for k, lp in enumerate(got):
        assert lp.token == ids[k + 1]
        assert lp.logprob == pytest.approx(float(oracle[k, ids[k + 1]]), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(oracle[k], top).indices.tolist()


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-gemma3", "tiny-kimi-linear"])
def test_prompt_logprobs_equal_transformers_over_chunks_and_skip_the_cache(name: str) -> None:
    engine = _engine(name)  # chunks of 8: every prompt but the first is computed over several steps
    first = engine.generate(PROMPTS, NEW)  # now the cache holds every prompt
    params = [SamplingParams(NEW, prompt_logprobs=3, logprobs=1 if i % 2 else None) for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params)
    for ids, out, before in zip(PROMPTS, outs, first, strict=True):
        assert out.output_ids == before.output_ids  # the same tokens, computed whole
        assert out.cached_tokens == 0  # a hit's positions have no logits: the prompt is computed whole
        _check_prompt(name, ids, out.prompt_logprobs, 3)
    again = engine.generate(PROMPTS[-1:], NEW)  # what they computed is cached for the others
    assert again[0].cached_tokens > 0 and again[0].prompt_logprobs is None


def test_prompt_logprobs_survive_retraction() -> None:
    weights, config = build_random("tiny-qwen3-next")
    long = [prompt(200 + i, 3 + 4 * i) for i in range(18)]
    engine = Engine(config, weights, EngineConfig(gpu_memory=150_000, page_size=4, chunk_size=7, max_context=96))
    outs = engine.generate(long, [SamplingParams(8, prompt_logprobs=0) for _ in long])
    assert any(o.retractions for o in outs), "the budget was meant to force retractions"
    for ids, out in zip(long, outs, strict=True):
        _check_prompt("tiny-qwen3-next", ids, out.prompt_logprobs, 0)
