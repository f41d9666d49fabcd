"""With ``--tokenizer`` the server takes text prompts and returns text: a word-level tokenizer built here."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


def test_a_text_stream_decodes_a_window_per_token_not_every_token_so_far(server: Any) -> None:
    from hybridkv.server.text import TextStream

    tokenizer = server.state.config.tokenizer
    decoded = 0
    decode = tokenizer.decode

    def counted(ids: list[int]) -> str:
        nonlocal decoded
        decoded += len(ids)
        return str(decode(ids))

    tokenizer.decode = counted
    try:
        stream, n = TextStream(tokenizer), 200
        deltas = [stream.push([5 + i % 50], final=i == n - 1) for i in range(n)]
        assert stream.text == "".join(deltas) == " ".join(WORDS[5 + i % 50] for i in range(n))
        assert decoded <= 3 * n + n  # a window of 1-2 ids per token, and everything once at the end (was n^2)
    finally:
        del tokenizer.decode


CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, ça va? naïve café",
    "你好世界 こんにちは 안녕하세요",
    "emoji 🙂🚀 and    spaces\tand\nnew lines",
    "def f(x):\n    return x ** 2  # code",
] * 20


def _trained(kind: str, path: Path) -> Any:
    """A real BPE tokenizer trained here on ``CORPUS``: GPT-2's byte level, or SentencePiece's metaspace (the two
    ways real models spell spaces), saved and loaded as the server loads one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hybridkv.server import Tokenizer as ServerTokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>" if kind == "metaspace" else None))
    if kind == "byte_level":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"], initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(str(path))
    return ServerTokenizer(path)


@pytest.fixture(scope="module")
def real_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {kind: _trained(kind, tmp_path_factory.mktemp(kind)) for kind in ("byte_level", "metaspace")}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_text_stream_hands_out_what_a_whole_decode_gives_however_the_tokens_come(
    real_tokenizers: dict[str, Any], data: st.DataObject
) -> None:
    from hybridkv.server.text import TextStream

    tokenizer = real_tokenizers[data.draw(st.sampled_from(sorted(real_tokenizers)))]
    text = data.draw(st.sampled_from(CORPUS[:5]) | st.text(alphabet="ab çé你🙂 \n", max_size=40))
    ids = tokenizer.encode(text) + data.draw(st.lists(st.integers(0, 299), max_size=6))  # any ids, too
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    stream, deltas, start = TextStream(tokenizer), [], 0
    for end in [*cuts, len(ids)]:
        final = end == len(ids) and start <= end
        deltas.append(stream.push(ids[start:end], final=final))
        start = end
        if final:
            break
        joined = "".join(deltas)
        whole = tokenizer.decode(ids[:end])
        assert whole.startswith(joined) and (joined == whole or whole[len(joined) :].endswith("\ufffd") or not joined)
    assert "".join(deltas) == tokenizer.decode(ids) == stream.text
