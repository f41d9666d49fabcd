"""``/v1/chat/completions`` with the official ``openai`` client: the chat template renders the prompt, the answer's
text is the engine's tokens decoded (streamed and not), usage and cached tokens where clients read them, logprobs;
a tokenizer without a template and malformed messages are 400s naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from hybridkv.server.text import ByteTokenizer, Tokenizer
from tests.server.conftest import MODEL, stop_in

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "héllo ✓ 日本, what is a prefix cache?"},
]
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WORDS = ["<unk>", "<system>", "<user>", "<assistant>", "Answer", "briefly.", "what", "is", "a", "prefix", "cache?"]


def word_tokenizer(directory: Path, template: str | None) -> Path:
    """A real HF tokenizer (word level, ids < 256) saved to ``directory``, with ``template`` as its chat template."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def byte_server(start_server: Any) -> Any:
    return start_server(tokenizer=ByteTokenizer(256, [1, 2]))


def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_equals_the_engine_on_the_rendered_prompt_streamed_and_not(byte_server: Any, make_engine: Any) -> None:
    tok = ByteTokenizer(256, [1, 2])
    prompt = tok.render_chat(CHAT)
    reference = make_engine().generate([prompt], 12)[0].output_ids
    got = client(byte_server).chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0
    )
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == tok.decode(reference)
    assert got.usage is not None and got.usage.prompt_tokens == len(prompt)
    assert got.usage.completion_tokens == len(reference)
    chunks = list(
        client(byte_server).chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == got.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == got.choices[0].finish_reason and set(reasons[:-1]) == {None}
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None and usage.completion_tokens == len(reference)
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens > 0  # a repeat


def test_chat_logprobs(byte_server: Any) -> None:
    got = client(byte_server).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = got.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == got.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the chosen one is the most likely
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


def test_chat_stop_strings_streamed_and_not(byte_server: Any) -> None:
    oai = client(byte_server)
    same: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 32, "temperature": 0}
    extra = {"ignore_eos": True}
    text = oai.chat.completions.create(**same, extra_body=extra).choices[0].message.content
    assert text is not None
    stop = stop_in(text)
    want = text[: text.index(stop)]
    got = oai.chat.completions.create(**same, stop=stop, extra_body=extra)
    assert got.choices[0].message.content == want and got.choices[0].finish_reason == "stop"
    assert got.usage is not None and got.usage.completion_tokens < 32
    chunks = list(oai.chat.completions.create(**same, stop=[stop], stream=True, extra_body=extra))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.delta.content or "" for c in choices) == want and choices[-1].finish_reason == "stop"
    keep = {**extra, "include_stop_str_in_output": True}
    got = oai.chat.completions.create(**same, stop=stop, extra_body=keep)
    assert got.choices[0].message.content == want + stop


def test_chat_n_choices_are_the_seeded_draws_of_one_prompt_streamed_and_not(byte_server: Any) -> None:
    oai = client(byte_server)
    same: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 1.0}
    singles = [oai.chat.completions.create(**same, seed=5 + j) for j in range(3)]
    draws = [one.choices[0].message.content for one in singles]
    got = oai.chat.completions.create(**same, seed=5, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.message.content for c in got.choices] == draws  # choice j: the prompt drawn with seed 5 + j
    assert len(set(draws)) > 1, "three seeded draws came out the same"
    assert got.usage is not None and all(one.usage is not None for one in singles)
    assert got.usage.prompt_tokens == singles[0].usage.prompt_tokens  # type: ignore[union-attr]  # counted once
    assert got.usage.completion_tokens == sum(one.usage.completion_tokens for one in singles)  # type: ignore[union-attr]
    texts: dict[int, str] = {}
    roles: list[int] = []
    for chunk in oai.chat.completions.create(**same, seed=5, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.delta.role:
                roles.append(c.index)
    assert sorted(roles) == [0, 1, 2] and [texts[j] for j in range(3)] == draws


def test_a_saved_tokenizer_renders_its_own_template(start_server: Any, make_engine: Any, tmp_path: Path) -> None:
    tok = Tokenizer(word_tokenizer(tmp_path / "tok", TEMPLATE))
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "what is a prefix cache?"},
    ]
    prompt = tok.render_chat(messages)
    assert prompt == [
        1,
        4,
        5,
        2,
        6,
        7,
        8,
        9,
        10,
        3,
    ]  # <system> Answer briefly. <user> what is a prefix cache? <assistant>
    server = start_server(tokenizer=tok)
    got = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert got.usage is not None and got.usage.prompt_tokens == len(prompt)
    assert got.choices[0].message.content == tok.decode(make_engine().generate([prompt], 4)[0].output_ids)
    plain = start_server(tokenizer=Tokenizer(word_tokenizer(tmp_path / "plain", None)))
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(plain).chat.completions.create(model=MODEL, messages=messages, max_tokens=2)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x", ""]}, "stop[1]"),
    ],
)
def test_bad_chats_name_the_field(byte_server: Any, body: dict[str, Any], field: str) -> None:
    r = httpx.post(f"{byte_server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_a_server_without_a_tokenizer_says_what_to_add(start_server: Any) -> None:
    server = start_server()
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30
    )
    assert r.status_code == 400 and "--tokenizer" in r.json()["error"]["message"]
