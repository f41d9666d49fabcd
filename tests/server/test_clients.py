"""What real clients send and read (issue 34): every field of SGLang's ``GenerateReqInput`` and OpenAI's
completions body accepted at its neutral value, unknown fields ignored and counted, ``/flush_cache``,
``/server_info``, ``/get_model_info``, ``/v1/models/{id}``, cached tokens where clients look, and text through the
built-in byte tokenizer of the random models. One server (the byte tokenizer) serves every test here."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import OpenAI

from hybridkv.server import ByteTokenizer
from hybridkv.server.text import TextStream
from tests.server.conftest import MODEL, shared_prefix_prompts, stop_in
from tests.server.test_endpoints import metric, wait_idle

FAMILY = shared_prefix_prompts(2, groups=1, prefix=80, seed=314)  # a head nobody else in this module sends
TEXT = "héllo ✓ 日本 🙂"


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(tokenizer=ByteTokenizer(256))


def client(server: Any) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def ignored(server: Any, endpoint: str, field: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    try:
        return metric(text, f'hybridkv_ignored_request_fields_total{{endpoint="{endpoint}",field="{field}"}}')
    except AssertionError:
        return 0.0


def test_unknown_fields_are_ignored_and_counted_known_neutral_ones_accepted(server: Any) -> None:
    out = client(server).completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0, extra_body={"frobnicate": 1, "lora_path": None}
    )
    assert len(out.choices[0].token_ids) == 2  # type: ignore[attr-defined]
    assert ignored(server, "/v1/completions", "frobnicate") == 1
    sglang = {  # every GenerateReqInput field at the value SGLang's own client sends by default
        "input_ids": [5, 6, 7],
        "sampling_params": {
            "max_new_tokens": 2,
            "temperature": 0,
            "top_k": -1,
            "stop": [],
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "no_stop_trim": False,
            "stream_interval": None,
            "colour": "red",  # unknown inside sampling_params: ignored too
        },
        "return_logprob": False,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "token_ids_logprob": None,
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "modalities": [],
        "image_data": None,
        "session_params": None,
        "lora_path": None,
        "lora_id": None,
        "custom_logit_processor": None,
        "bootstrap_host": None,
        "bootstrap_port": None,
        "bootstrap_room": None,
        "data_parallel_rank": None,
        "background": False,
        "conversation_id": "c-1",
        "priority": None,
        "extra_key": None,
        "no_logs": False,
        "custom_labels": {"team": "a"},
        "return_bytes": False,
        "return_entropy": False,
        "return_routed_experts": False,
        "made_up_field": [1, 2],
    }
    for _ in range(2):
        r = post(server, "/generate", sglang)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == out.choices[0].token_ids  # type: ignore[attr-defined]
    assert ignored(server, "/generate", "made_up_field") == 2
    assert ignored(server, "/generate", "sampling_params.colour") == 2
    for path, prompt in (("/generate", "input_ids"), ("/v1/completions", "prompt")):
        err = post(server, path, {prompt: [5], "lora_path": "x"}).json()["error"]
        assert err["param"] == "lora_path" and err["message"].startswith("lora_path: LoRA adapters are not served")


def test_cached_tokens_in_usage_meta_info_and_sglext_then_flush_empties_the_cache(server: Any) -> None:
    before = wait_idle(server)
    start_pages = metric(before, "hybridkv_live_pages")
    oai = client(server)
    repeat = {"input_ids": FAMILY[1], "sampling_params": {"max_new_tokens": 2}}
    oai.completions.create(model=MODEL, prompt=FAMILY[0], max_tokens=2, temperature=0)
    stream = oai.completions.create(
        model=MODEL,
        prompt=FAMILY[1],
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_cached_tokens_details": True},
    )
    chunks = [c.model_dump() for c in stream]
    cached = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= 80  # within the shared head
    assert chunks[-1]["sglext"]["cached_tokens_details"] == {"device": cached, "host": 0, "storage": 0}
    details = {"prompt": FAMILY[1], "max_tokens": 2, "return_cached_tokens_details": True}
    plain = post(server, "/v1/completions", details)
    assert plain.json()["sglext"]["cached_tokens_details"]["device"] >= cached
    meta = post(server, "/generate", repeat).json()["meta_info"]
    assert meta["cached_tokens"] >= cached and meta["cached_tokens_details"]["device"] == meta["cached_tokens"]
    assert metric(wait_idle(server), "hybridkv_cached_pages") > 0
    r = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert r.status_code == 200 and r.text.startswith("Cache flushed")
    text = wait_idle(server)
    assert metric(text, "hybridkv_cached_pages") == 0 and metric(text, "hybridkv_cached_states") == 0
    assert metric(text, "hybridkv_live_pages") == start_pages and metric(text, "hybridkv_live_slots") == 0
    server.backend.call(lambda e: (e.mem.verify(), e.cache.check()))
    meta = post(server, "/generate", repeat).json()["meta_info"]
    assert meta["cached_tokens"] == 0  # nothing left to hit
    assert httpx.get(f"{server.url}/flush_cache?host=true", timeout=30).status_code == 200  # GET too, as SGLang
    err = httpx.post(f"{server.url}/flush_cache?host=maybe", timeout=30).json()["error"]
    assert err["param"] == "host"


def test_a_streamed_chats_last_choice_chunk_carries_sglext_without_a_usage_chunk(server: Any) -> None:
    """SGLang's benchmark client asks for ``return_cached_tokens_details`` and no usage chunk: it reads the cached
    tokens off the chunk that ends a choice."""
    words = " ".join(f"w{i}" for i in range(40))  # one message no other test sends: its head is cached here only
    body = {"messages": [{"role": "user", "content": words}], "max_tokens": 2, "stream": True}
    body |= {"return_cached_tokens_details": True}
    seen = []
    for _ in range(2):
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        assert all("usage" not in c or c["usage"] is None for c in chunks)  # none asked for
        (last,) = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
        assert all("sglext" not in c for c in chunks if c is not last)
        seen.append(last["sglext"]["cached_tokens_details"])
    assert seen[0]["device"] == 0 and seen[1]["device"] > 0 and seen[1]["host"] == 0


def test_flush_cache_is_refused_while_a_request_runs(server: Any) -> None:
    body = {"input_ids": FAMILY[0], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}, "stream": True}
    answer: list[httpx.Response] = []
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):  # it runs: flush from another connection
                answer.append(httpx.post(f"{server.url}/flush_cache", timeout=30))
                break
    assert answer[0].status_code == 400
    assert "cache not flushed: 1 requests are running or waiting" in answer[0].json()["error"]["message"]
    wait_idle(server)  # the stream's disconnect aborted it
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200


def test_server_info_model_info_and_model_card(server: Any) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{server.url}{path}", timeout=30).json()
        assert info["version"] and info["served_model_name"] == MODEL and info["context_length"] == 512
        assert info["page_size"] == 16 and info["max_total_num_tokens"] > 512 and info["max_running_requests"] > 0
    model = httpx.get(f"{server.url}/get_model_info", timeout=30).json()
    assert model["is_generation"] is True and model["model_path"] == MODEL
    assert model["tokenizer_path"].startswith("builtin:bytes")
    card = client(server).models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    r = httpx.get(f"{server.url}/v1/models/org/other-model", timeout=30)
    assert r.status_code == 404 and "'org/other-model' is not served" in r.json()["error"]["message"]


def test_byte_tokenizer_text_round_trip_streamed_and_not(server: Any) -> None:
    tok = ByteTokenizer(256)
    prompt = tok.encode(TEXT)
    assert len(prompt) == len(TEXT.encode()) and tok.decode(prompt) == TEXT
    oai = client(server)
    plain = oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=12, temperature=0)
    ids = plain.choices[0].token_ids  # type: ignore[attr-defined]
    assert plain.usage is not None and plain.usage.prompt_tokens == len(prompt)
    assert plain.choices[0].text == tok.decode(ids)
    streamed = oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text
    body = {"text": TEXT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as resp:
        last = [json.loads(x.removeprefix("data: ")) for x in resp.iter_lines() if x.startswith("data: {")][-1]
    assert last["output_ids"] == ids and last["text"] == plain.choices[0].text
    assert last["meta_info"]["prompt_tokens"] == len(prompt)


def test_a_byte_stream_hands_out_whole_characters_only() -> None:
    tok = ByteTokenizer(300, special_ids=[2])
    ids = tok.encode(TEXT)
    stream = TextStream(tok)
    deltas = [stream.push([t], final=False) for t in ids]
    assert "".join(deltas) == TEXT and not any("\ufffd" in d for d in deltas)
    assert [d for d in deltas if d][1:4] == ["é", "l", "l"]  # é's two bytes: one delta, on the second
    # ids that are no text: a special id is nothing, an id past the bytes and invalid UTF-8 are U+FFFD
    assert tok.decode([104, 2, 105, 299, 0xFF, 0xE6]) == "hi\ufffd\ufffd\ufffd"
    tail = TextStream(tok)
    assert tail.push([0xE6, 0x97], final=False) == ""  # an incomplete character is held back
    assert tail.push([], final=True) == "\ufffd"  # and at the end given as what it is


STOP_PROMPT = [40, 41, 42, 43]


def cut_at(ids: list[int], stop: str) -> list[int]:
    """The tokens up to the one whose text completes ``stop`` (byte tokens)."""
    tok = ByteTokenizer(256)
    return ids[: next(k for k in range(len(ids) + 1) if stop in tok.decode(ids[:k]))]


def test_stop_strings_cut_completions_streamed_and_not_and_keep_them_when_asked(server: Any) -> None:
    oai = client(server)
    same: dict[str, Any] = {"model": MODEL, "prompt": STOP_PROMPT, "max_tokens": 32, "temperature": 0}
    cut, keep = {"ignore_eos": True}, {"ignore_eos": True, "include_stop_str_in_output": True}
    whole = oai.completions.create(**same, extra_body=cut)
    text, ids = whole.choices[0].text, whole.choices[0].token_ids  # type: ignore[attr-defined]
    stop = stop_in(text)
    want, kept = text[: text.index(stop)], cut_at(ids, stop)
    assert 0 < len(kept) < len(ids)
    got = oai.completions.create(**same, stop=[stop, "never!"], extra_body=cut)
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    assert got.choices[0].token_ids == kept  # type: ignore[attr-defined]
    assert got.usage is not None and got.usage.completion_tokens == len(kept)
    usage = {"include_usage": True}
    chunks = list(oai.completions.create(**same, stop=stop, stream=True, stream_options=usage, extra_body=cut))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == want
    assert [c.finish_reason for c in choices][-1] == "stop" and {c.finish_reason for c in choices[:-1]} <= {None}
    assert [t for c in choices for t in c.token_ids] == kept  # type: ignore[attr-defined]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(kept)
    scored = oai.completions.create(**same, stop=stop, logprobs=1, extra_body=cut).choices[0]
    assert scored.text == want and scored.logprobs is not None and len(scored.logprobs.tokens or ()) == len(kept)
    got = oai.completions.create(**same, stop=stop, extra_body=keep)
    assert got.choices[0].text == want + stop and got.choices[0].finish_reason == "stop"
    streamed = oai.completions.create(**same, stop=stop, stream=True, extra_body=keep)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want + stop


def test_stop_strings_on_generate_name_the_match_and_no_stop_trim_keeps_it(server: Any) -> None:
    base = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    whole = post(server, "/generate", {"input_ids": STOP_PROMPT, "sampling_params": base}).json()
    text, ids = whole["text"], whole["output_ids"]
    stop = stop_in(text)
    want, kept = text[: text.index(stop)], cut_at(ids, stop)
    got = post(server, "/generate", {"input_ids": STOP_PROMPT, "sampling_params": {**base, "stop": stop}}).json()
    assert got["text"] == want and got["output_ids"] == kept
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert got["meta_info"]["completion_tokens"] == len(kept)
    body = {"input_ids": STOP_PROMPT, "sampling_params": {**base, "stop": [stop], "no_stop_trim": True}, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as resp:
        chunks = [json.loads(x.removeprefix("data: ")) for x in resp.iter_lines() if x.startswith("data: {")]
    assert all((want + stop).startswith(c["text"]) for c in chunks)  # never past the stop string
    assert chunks[-1]["text"] == want + stop and chunks[-1]["output_ids"] == kept
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    batch = {  # per prompt: one with a stop string, one without
        "input_ids": [STOP_PROMPT, STOP_PROMPT],
        "sampling_params": [{**base, "stop": stop}, base],
    }
    first, second = post(server, "/generate", batch).json()
    assert first["text"] == want and second["text"] == text and second["meta_info"]["finish_reason"]["type"] == "length"


def test_a_stop_string_ends_the_request_in_the_engine_and_its_memory_comes_back(server: Any) -> None:
    before = wait_idle(server)
    aborted = metric(before, "hybridkv_engine_aborted_requests_total")
    base = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    text = post(server, "/generate", {"input_ids": STOP_PROMPT, "sampling_params": base}).json()["text"]
    stop = stop_in(text)
    long = {**base, "max_new_tokens": 400, "stop": stop}  # would run 400 tokens without the stop
    got = post(server, "/generate", {"input_ids": STOP_PROMPT, "sampling_params": long}).json()
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop} and len(got["output_ids"]) < 32
    after = wait_idle(server)
    assert metric(after, "hybridkv_engine_aborted_requests_total") == aborted + 1  # stopped in the engine at once
    assert metric(after, "hybridkv_request_pages") == 0 and metric(after, "hybridkv_request_slots") == 0
    assert metric(after, 'hybridkv_requests_finished_total{finish_reason="stop"}') >= 1
    server.backend.call(lambda e: (e.mem.verify(), e.cache.check()))


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": [5], "stop": ["a", ""]}, "stop[1]"),
        ("/v1/completions", {"prompt": [5], "stop": [str(i) for i in range(17)]}, "stop"),
        ("/generate", {"input_ids": [5], "sampling_params": {"stop": 5}}, "sampling_params.stop"),
        ("/generate", {"input_ids": [[5], [6]], "sampling_params": [{}, {"stop": [""]}]}, "sampling_params[1].stop[0]"),
        ("/generate", {"input_ids": [5], "sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
    ],
)
def test_bad_stop_strings_name_the_field(server: Any, path: str, body: dict[str, Any], field: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: ")


def test_generate_n_samples_in_sglangs_order_with_their_own_ids(server: Any) -> None:
    """``sampling_params.n``: a list answer, the whole batch once per sample (output k * B + i is prompt i's k-th,
    drawn with its seed plus k), rids ``<rid>_<k>``; streamed, each chunk names its output's index."""
    a, b = FAMILY
    sp = {"max_new_tokens": 6, "temperature": 1.0, "seed": 21}

    def single(prompt: list[int], seed: int) -> list[int]:
        body = {"input_ids": prompt, "sampling_params": {**sp, "seed": seed}}
        out: list[int] = post(server, "/generate", body).json()["output_ids"]
        return out

    one = post(server, "/generate", {"input_ids": a, "sampling_params": {**sp, "n": 2}, "rid": "x"}).json()
    assert isinstance(one, list) and [o["output_ids"] for o in one] == [single(a, 21), single(a, 22)]
    assert [o["meta_info"]["id"] for o in one] == ["x_0", "x_1"]
    both = post(server, "/generate", {"input_ids": [a, b], "sampling_params": {**sp, "n": 2}}).json()
    assert [o["output_ids"] for o in both] == [single(a, 21), single(b, 21), single(a, 22), single(b, 22)]
    assert both[2]["meta_info"]["cached_tokens"] > 0  # the second sample of a prompt finds it in the cache
    body = {"input_ids": a, "sampling_params": {**sp, "n": 2}, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as resp:
        chunks = [json.loads(x.removeprefix("data: ")) for x in resp.iter_lines() if x.startswith("data: {")]
    last = {c["index"]: c["output_ids"] for c in chunks}
    assert last == {0: single(a, 21), 1: single(a, 22)}


def test_nulls_where_openai_allows_them_and_a_flush_once_the_backend_stopped(server: Any) -> None:
    body = {"prompt": [5, 6], "max_tokens": 2, "n": None, "echo": None, "stream": None, "logprobs": None}
    assert post(server, "/v1/completions", body).status_code == 200
    server.backend.close(10)  # the last test of the module: its server serves no more
    r = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert r.status_code == 503 and r.json()["error"]["message"].startswith("not serving:")
