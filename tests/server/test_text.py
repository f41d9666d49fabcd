"""With ``--tokenizer`` the server takes text prompts and returns text: a word-level tokenizer built here."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.server.conftest import MODEL

WORDS = [f"w{i}" for i in range(256)]  # token id i is the word "w{i}"


@pytest.fixture(scope="module")
def server(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hybridkv.server import Tokenizer as ServerTokenizer

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))
    return start_server(tokenizer=ServerTokenizer(Path(path)))


def test_text_prompts_give_the_same_tokens_as_ids(server: Any) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    ids = [5, 17, 99, 200, 31, 8]
    text = " ".join(WORDS[i] for i in ids)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0).choices[0]
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0).choices[0]
    assert by_text.token_ids == by_ids.token_ids  # type: ignore[attr-defined]
    assert by_text.text.split() == [WORDS[i] for i in by_ids.token_ids]  # type: ignore[attr-defined]
    stream = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices).split() == by_text.text.split()
    body = {"text": [text, text], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    answers = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert [a["output_ids"] for a in answers] == [by_ids.token_ids] * 2  # type: ignore[attr-defined]
    assert answers[0]["text"] == by_text.text
    assert answers[0]["meta_info"]["prompt_tokens"] == len(ids)
    # SGLang's stream: each chunk's text is all of it so far (decoded by the engine's thread, as it writes)
    body = {"text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as resp:
        texts = [json.loads(x.removeprefix("data: "))["text"] for x in resp.iter_lines() if x.startswith("data: {")]
    assert len(texts) == 6 and texts[-1] == by_text.text
    assert all(b.startswith(a) and len(a) < len(b) for a, b in itertools.pairwise(texts))


def test_a_text_stream_decodes_once_per_new_token_not_once_per_use(server: Any) -> None:
    from hybridkv.server.text import TextStream

    tokenizer = server.state.config.tokenizer
    calls = 0
    decode = tokenizer.decode

    def counted(ids: list[int]) -> str:
        nonlocal calls
        calls += 1
        return str(decode(ids))

    tokenizer.decode = counted
    try:
        stream = TextStream(tokenizer)
        deltas = [stream.push([i], final=i == 9) + "|" + stream.text for i in range(5, 10)]
        assert calls == 5  # push, then text: one decode for both
        assert deltas[-1] == " w9|w5 w6 w7 w8 w9" and stream.text == "w5 w6 w7 w8 w9" and calls == 5
    finally:
        del tokenizer.decode
