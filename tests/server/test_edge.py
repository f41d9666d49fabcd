"""Bad input at the edge: 400 / 401 / 404 / 413 as JSON naming the field, never a 500; the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 64 * 1024
GOOD = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(api_key=API_KEY, max_body_bytes=MAX_BODY)


def post(server: Any, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else None
    return httpx.post(
        f"{server.url}{path}",
        json=None if content is not None else body,
        content=content,
        headers=AUTH if headers is None else headers,
        timeout=30,
    )


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == status and "Traceback" not in err["message"]
    return err


BAD_COMPLETIONS = [
    ({"prompt": GOOD, "max_tokens": "8"}, "max_tokens"),  # a string is not an integer
    ({"prompt": GOOD, "max_tokens": True}, "max_tokens"),  # nor is a bool
    ({"prompt": GOOD, "max_tokens": 0}, "max_tokens"),
    ({"prompt": GOOD, "max_tokens": 100_000}, "max_tokens"),  # beyond the context: names the budget
    ({"prompt": [5, 256, 7]}, "prompt"),  # outside the vocabulary [0, 256)
    ({"prompt": [5, -1]}, "prompt"),
    ({"prompt": [[5, 6], [7, 999]]}, "prompt[1]"),
    ({"prompt": [5, 6.5]}, "prompt[1]"),
    ({"prompt": [5, "6"]}, "prompt[1]"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[5], []]}, "prompt[1]"),
    ({}, "prompt"),
    ({"prompt": "hello"}, "prompt"),  # text without a tokenizer
    ({"prompt": GOOD, "temperature": -0.5}, "temperature"),
    ({"prompt": GOOD, "top_p": 0}, "top_p"),
    ({"prompt": GOOD, "top_k": -3}, "top_k"),
    ({"prompt": GOOD, "seed": -1}, "seed"),
    ({"prompt": GOOD, "stop_token_ids": [300]}, "stop_token_ids"),
    ({"prompt": GOOD, "n": 0}, "n"),  # n > 1 is served (test_logprobs); 0 asks for nothing
    ({"prompt": GOOD, "logprobs": 25}, "logprobs"),  # 0 to 20 are served
    ({"prompt": GOOD, "stop": ["\n"]}, "stop"),  # stop strings match text: this server has no tokenizer
    ({"prompt": GOOD, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": GOOD, "lora_path": "x"}, "lora_path"),  # a known field asking for what is not served
    ({"prompt": GOOD, "min_tokens": 2}, "min_tokens"),
    ({"prompt": GOOD, "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": GOOD, "bootstrap_host": "10.0.0.1"}, "bootstrap_host"),
]

BAD_GENERATE = [
    ({"input_ids": GOOD, "sampling_params": {"max_new_tokens": 600}}, "sampling_params.max_new_tokens"),
    ({"input_ids": GOOD, "sampling_params": {"max_new_tokens": "4"}}, "sampling_params.max_new_tokens"),
    ({"input_ids": GOOD, "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"input_ids": [GOOD, GOOD], "sampling_params": [{}, {"temperature": -1}]}, "sampling_params[1].temperature"),
    ({"input_ids": [GOOD, GOOD], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [GOOD, [1, 2, 1000]]}, "input_ids[1]"),
    ({"input_ids": "5 6 7"}, "input_ids"),
    ({"input_ids": GOOD, "text": "hi"}, "text"),
    ({"input_ids": GOOD, "rid": ["a", "b"]}, "rid"),
    ({"input_ids": [GOOD, GOOD], "rid": ["a", "a"]}, "rid"),
    ({"input_ids": GOOD, "rid": {"a": 1}}, "rid"),  # fits no member of ``str | list[str]``: named as sent
    ({"input_ids": GOOD, "sampling_params": {"stop": "x"}}, "sampling_params.stop"),  # no tokenizer
    ({"input_ids": GOOD, "return_logprob": [True, True]}, "return_logprob"),  # two values for one prompt
    ({"input_ids": GOOD, "stream": "true"}, "stream"),
    ({"input_ids": GOOD, "lora_path": "x"}, "lora_path"),
    ({"input_ids": [GOOD, GOOD], "lora_path": [None, "x"]}, "lora_path"),
    ({"input_ids": GOOD, "image_data": "http://x/y.png"}, "image_data"),
    ({"input_ids": GOOD, "return_logprob": True, "top_logprobs_num": 30}, "top_logprobs_num"),
    ({"input_ids": GOOD, "data_parallel_rank": 1}, "data_parallel_rank"),
    ({"input_ids": GOOD, "sampling_params": {"n": 65}}, "sampling_params.n"),
    ({"input_ids": [GOOD, GOOD], "sampling_params": [{"n": 2}, {"n": 3}]}, "sampling_params[1].n"),
    ({"input_ids": GOOD, "sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
    ({"input_ids": GOOD, "sampling_params": {"logit_bias": {"5": 1.0}}}, "sampling_params.logit_bias"),
]


@pytest.mark.parametrize(("body", "field"), BAD_COMPLETIONS)
def test_bad_completion_bodies_name_the_field(server: Any, body: dict[str, Any], field: str) -> None:
    err = error_of(post(server, "/v1/completions", body), 400)
    assert err["param"] == field and err["message"].startswith(f"{field}: ")


@pytest.mark.parametrize(("body", "field"), BAD_GENERATE)
def test_bad_generate_bodies_name_the_field(server: Any, body: dict[str, Any], field: str) -> None:
    err = error_of(post(server, "/generate", body), 400)
    assert err["param"] == field and err["message"].startswith(f"{field}: ")


def test_beyond_the_context_names_the_budget(server: Any) -> None:
    err = error_of(post(server, "/v1/completions", {"prompt": GOOD, "max_tokens": 508}), 400)
    assert "at most 512 tokens" in err["message"] and "64MiB" in err["message"]
    ok = post(server, "/v1/completions", {"prompt": GOOD, "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200  # 5 + 507 fits exactly: the bound is the context, not one less


def test_not_json_and_not_an_object(server: Any) -> None:
    assert error_of(post(server, "/generate", b"{not json"), 400)["param"] == "body"
    assert error_of(post(server, "/v1/completions", b"[1, 2]"), 400)["param"] == "body"


def test_api_key_is_required_except_on_health(server: Any) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for path in ("/generate", "/v1/completions", "/abort_request"):
            r = post(server, path, {"input_ids": GOOD}, headers)
            assert error_of(r, 401)["param"] == "authorization"
            assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{server.url}/metrics", headers=headers, timeout=10).status_code == 401
        assert httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_oversized_bodies_answer_413(server: Any) -> None:
    big = {"prompt": [5] * (MAX_BODY // 2)}  # ~ 3 bytes per id: over the limit
    assert error_of(post(server, "/v1/completions", big), 413)["param"] == "body"

    def chunks() -> Any:  # no Content-Length: the limit holds on the bytes read
        yield b'{"prompt": ['
        for _ in range(MAX_BODY // 1000 + 2):
            yield b"5, " * 333 + b"5, "
        yield b"5]}"

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert error_of(r, 413)["param"] == "body"


def test_unknown_paths_methods_and_models(server: Any) -> None:
    assert error_of(httpx.get(f"{server.url}/v2/nothing", headers=AUTH, timeout=10), 404)["message"]
    assert error_of(httpx.get(f"{server.url}/generate", headers=AUTH, timeout=10), 405)
    err = error_of(post(server, "/v1/completions", {"model": "gpt-4", "prompt": GOOD}), 404)
    assert err["param"] == "model"


def test_the_official_client_sees_the_field_and_the_server_keeps_serving(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=[5, 6, 100_000], max_tokens=2)
    assert "outside the vocabulary" in str(bad.value)
    out = client.completions.create(model=MODEL, prompt=GOOD, max_tokens=3, temperature=0)
    assert len(out.choices[0].token_ids) == 3  # type: ignore[attr-defined]
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


def test_two_authorization_headers_are_refused(server: Any) -> None:
    for pair in (["Bearer wrong", f"Bearer {API_KEY}"], [f"Bearer {API_KEY}", f"Bearer {API_KEY}"]):
        headers = [("Authorization", value) for value in pair]
        r = httpx.post(f"{server.url}/generate", json={"input_ids": GOOD}, headers=headers, timeout=30)
        assert error_of(r, 400)["param"] == "authorization"
    health = httpx.get(f"{server.url}/health", headers=[("Authorization", "a"), ("Authorization", "b")], timeout=10)
    assert error_of(health, 400)["param"] == "authorization"
