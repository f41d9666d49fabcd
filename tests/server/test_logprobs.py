"""Log-probabilities over HTTP: OpenAI ``logprobs`` / ``echo`` (the official client) and SGLang ``return_logprob``,
each figure equal to ``transformers``' log-softmax of the same weights within 1e-4 (fp32)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import torch

from tests.engine.harness import hf_model
from tests.server.conftest import MODEL

PROMPT = [11, 42, 7, 99, 3, 250, 17, 64, 5, 180, 33, 71]


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server()


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def hf_logsoftmax(ids: list[int]) -> torch.Tensor:
    """``(len(ids), vocab)``: row ``p`` is the distribution of the token after position ``p``."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(MODEL)(torch.tensor([ids])).logits[0].float(), dim=-1)


def name(token: int) -> str:
    return f"token_id:{token}"  # this server has no tokenizer: tokens are named by id


def test_completion_logprobs_equal_transformers(client: openai.OpenAI) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    choice = got.choices[0]
    tokens = choice.model_extra["token_ids"]  # type: ignore[index]
    oracle = hf_logsoftmax(PROMPT + tokens)[len(PROMPT) - 1 :]
    lp = choice.logprobs
    assert lp is not None and lp.tokens == [name(t) for t in tokens]
    assert lp.token_logprobs == pytest.approx([float(oracle[k, t]) for k, t in enumerate(tokens)], abs=1e-4)
    for k, top in enumerate(lp.top_logprobs or []):
        best = torch.topk(oracle[k], 3)
        assert list(top) == [name(t) for t in best.indices.tolist()]
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=1e-4)
    assert lp.text_offset == [sum(len(name(t)) for t in tokens[:k]) for k in range(len(tokens))]


def test_echo_scores_the_prompt_like_an_evaluation_harness(client: openai.OpenAI) -> None:
    """lm-evaluation-harness' loglikelihood request: echo, logprobs, max_tokens 0."""
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, temperature=0, echo=True, logprobs=1)
    choice = got.choices[0]
    oracle = hf_logsoftmax(PROMPT)
    lp = choice.logprobs
    assert lp is not None and lp.tokens == [name(t) for t in PROMPT]
    assert lp.token_logprobs is not None and lp.token_logprobs[0] is None
    expected = [float(oracle[k, t]) for k, t in enumerate(PROMPT[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert [list(top) for top in lp.top_logprobs[1:]] == [[name(int(oracle[k].argmax()))] for k in range(11)]
    assert got.usage is not None and got.usage.completion_tokens == 0
    assert choice.model_extra["token_ids"] == [] and choice.finish_reason == "length"  # type: ignore[index]
    # with generated tokens: the prompt's figures, then the new tokens'
    more = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=0)
    tokens = more.choices[0].model_extra["token_ids"]  # type: ignore[index]
    full = hf_logsoftmax(PROMPT + tokens)
    lps = more.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
    assert lps is not None and len(lps) == len(PROMPT) + 3
    want = [float(full[k, t]) for k, t in enumerate((PROMPT + tokens)[1:])]
    assert lps[1:] == pytest.approx(want, abs=1e-4)
    assert more.usage is not None and more.usage.prompt_tokens_details is not None
    assert more.usage.prompt_tokens_details.cached_tokens == 0  # the prompt was computed whole


def test_streamed_logprobs_equal_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT[:7], max_tokens=6, temperature=0, logprobs=2)
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT[:7], max_tokens=6, temperature=0, logprobs=2, stream=True)
    )
    streamed: list[float] = []
    offsets: list[int] = []
    for chunk in chunks:
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.token_logprobs or []
                offsets += c.logprobs.text_offset or []
    assert whole.choices[0].logprobs is not None
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert offsets == whole.choices[0].logprobs.text_offset


def test_generate_return_logprob_equals_transformers(server: Any) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
    }
    got = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    meta, tokens = got["meta_info"], got["output_ids"]
    oracle = hf_logsoftmax(PROMPT + tokens)
    inp, out = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert inp[0] == [None, PROMPT[0], None] and [t for _, t, _ in inp] == PROMPT
    assert [v for v, _, _ in inp[1:]] == pytest.approx(
        [float(oracle[k, t]) for k, t in enumerate(PROMPT[1:])], abs=1e-4
    )
    assert [t for _, t, _ in out] == tokens
    at = len(PROMPT) - 1
    assert [v for v, _, _ in out] == pytest.approx([float(oracle[at + k, t]) for k, t in enumerate(tokens)], abs=1e-4)
    assert [[t for _, t, _ in top] for top in meta["output_top_logprobs"]] == [
        torch.topk(oracle[at + k], 2).indices.tolist() for k in range(len(tokens))
    ]
    assert meta["input_top_logprobs"][0] is None
    plain = httpx.post(f"{server.url}/generate", json={**body, "return_logprob": False}, timeout=60).json()
    assert "output_token_logprobs" not in plain["meta_info"] and plain["output_ids"] == tokens


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "stream": True}, "echo"),
        ("/generate", {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 99}, "top_logprobs_num"),
        ("/generate", {"input_ids": PROMPT, "return_logprob": [True, False]}, "return_logprob"),
        ("/generate", {"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [5]}, "token_ids_logprob"),
    ],
)
def test_bad_logprob_requests_name_the_field(server: Any, path: str, body: dict[str, Any], field: str) -> None:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_n_choices_share_the_prompt_through_the_cache(client: openai.OpenAI) -> None:
    prompt = [9, *PROMPT, *PROMPT, 8]  # 26 tokens: a page and more to share
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    tokens = [c.model_extra["token_ids"] for c in greedy.choices]  # type: ignore[index]
    assert tokens[0] == tokens[1] == tokens[2]
    assert greedy.usage is not None and greedy.usage.prompt_tokens == len(prompt)  # the prompt counted once
    assert greedy.usage.completion_tokens == 12
    sampled = client.completions.create(
        model=MODEL, prompt=[prompt, PROMPT], max_tokens=6, temperature=1.0, seed=11, n=2, logprobs=0
    )
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    outs = [c.model_extra["token_ids"] for c in sampled.choices]  # type: ignore[index]
    assert outs[0] != outs[1] or outs[2] != outs[3], "two seeded draws of one prompt came out the same twice"
    again = client.completions.create(
        model=MODEL, prompt=[prompt, PROMPT], max_tokens=6, temperature=1.0, seed=11, n=2, logprobs=0
    )
    assert [c.model_extra["token_ids"] for c in again.choices] == outs  # type: ignore[index]
    for bad in (0, 65):
        with pytest.raises(openai.BadRequestError, match="n: "):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=bad)
