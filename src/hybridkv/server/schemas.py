"""The request bodies the server accepts, validated at the edge, and the one error shape it answers.

Every body is parsed by a strict pydantic model (no coercion: ``"16"`` is not an integer, ``true``
is not 1; unknown fields are refused, so a misspelt option never goes unnoticed), then turned into
``SamplingParams`` and token prompts; every refusal is an ``ApiError`` whose ``param`` names the
field as the client spelt it (``max_tokens``, ``prompt[2][5]``, ``sampling_params.top_p``).

Invariants:
- A field the server accepts but cannot honour (``n`` > 1, ``logprobs``, ``echo``, stop strings,
  penalties) is refused with a 400 naming it, never silently ignored; neutral values pass.
- A prompt is a non-empty list of integer token ids (or a list of such lists: a batch), or text
  when a tokenizer is configured; ids outside the vocabulary and prompt + new tokens beyond
  the context are refused by ``check_request`` and ``check_fits``, named per endpoint.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from hybridkv.engine.request import RequestError, SamplingParams
from hybridkv.server.backend import ModelInfo
from hybridkv.server.text import Tokenizer


class ApiError(Exception):
    """An answer other than 200: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error"),
                "param": self.param,
                "code": self.status,
            }
        }


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CompletionBody(_Strict):
    """OpenAI ``/v1/completions`` (vLLM's extensions: ``top_k``, ``stop_token_ids``, ``ignore_eos``,
    ``return_token_ids``, ``cache_salt``)."""

    model: str | None = None
    prompt: Any = None
    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None


class SglangSampling(_Strict):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    sampling_seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    n: int = 1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    skip_special_tokens: bool = True


class GenerateBody(_Strict):
    """SGLang-native ``/generate``."""

    input_ids: Any = None
    text: Any = None
    sampling_params: SglangSampling | list[SglangSampling] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    cache_salt: str | None = None


class AbortBody(_Strict):
    rid: str | None = None
    abort_all: bool = False


def parse(model: type[_Strict], raw: bytes) -> Any:
    """``model`` from a JSON body, or a 400 naming the first bad field."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = _path(err["loc"])
        if err["type"] == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {err['msg']}", "body") from None
        if not where:
            raise ApiError(400, f"the body must be a JSON object: {err['msg']}", "body") from None
        raise ApiError(400, f"{where}: {err['msg']}", where) from None


_SCALAR_TAGS = frozenset({"str", "int", "float", "bool"})


def _path(loc: tuple[int | str, ...]) -> str:
    """``("prompt", 2)`` -> ``prompt[2]``; union-member tags pydantic inserts (``str``, ``list[int]``, a model's
    class name) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part[:1].isupper() or part in _SCALAR_TAGS:
            continue
        else:
            out += f".{part}" if out else part
    return out


def refuse_unsupported(checks: list[tuple[bool, str, str]]) -> None:
    """400 for the first ``(given, field, why)`` that is given."""
    for given, field, why in checks:
        if given:
            raise ApiError(400, f"{field}: {why}", field)


def token_prompts(value: Any, field: str, tokenizer: Tokenizer | None) -> tuple[list[list[int]], bool]:
    """The prompts of ``value`` and whether it was a batch: token ids, a list of them, text, a list of texts."""
    if value is None:
        raise ApiError(400, f"{field}: missing; give a list of token ids (or a list of such lists)", field)
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        if tokenizer is None:
            raise ApiError(
                400,
                f"{field}: text prompts need a tokenizer and this server has none (start it with --tokenizer DIR); "
                "send token ids instead",
                field,
            )
        texts = [value] if isinstance(value, str) else value
        return [tokenizer.encode(t) for t in texts], not isinstance(value, str)
    if not isinstance(value, list) or not value:
        raise ApiError(400, f"{field}: must be a non-empty list of token ids (or a list of such lists)", field)
    batch = isinstance(value[0], list)
    prompts = value if batch else [value]
    for i, ids in enumerate(prompts):
        where = f"{field}[{i}]" if batch else field
        if not isinstance(ids, list):
            raise ApiError(400, f"{where}: must be a list of token ids, got {type(ids).__name__}", where)
        for j, t in enumerate(ids):
            if type(t) is not int:
                raise ApiError(
                    400, f"{where}[{j}]: must be an integer token id, got {type(t).__name__} {t!r}", f"{where}[{j}]"
                )
    return prompts, batch


def sampling(fields: dict[str, str], **values: Any) -> SamplingParams:
    """``SamplingParams(**values)``, its ``RequestError`` as a 400 naming the client's field."""
    try:
        return SamplingParams(**values)
    except RequestError as exc:
        raise named(exc, fields) from None


def named(exc: RequestError, fields: dict[str, str], index: int | None = None) -> ApiError:
    """A 400 for an engine ``RequestError``, its field spelt as the client did (``fields``: engine name ->
    client name; ``index``: the prompt's place in a batch, for the prompt field)."""
    field = fields.get(exc.field, exc.field)
    if index is not None and exc.field == "input_ids":
        field = f"{field}[{index}]"
    message = str(exc).split(": ", 1)[1]
    return ApiError(400, f"{field}: {message}", field)


def check_fits(prompt: list[int], params: SamplingParams, info: ModelInfo, prompt_field: str, max_field: str) -> None:
    """400 naming the context and the memory budget when prompt + new tokens cannot be held by one
    request even alone."""
    total = len(prompt) + params.max_new_tokens
    if total > info.max_context:
        raise ApiError(
            400,
            f"{max_field}: {prompt_field} of {len(prompt)} tokens + {params.max_new_tokens} new = {total} tokens "
            f"does not fit: one request may hold at most {info.max_context} tokens (the context; the memory "
            f"budget of {info.memory_budget} is sized for one such request); shorten the prompt or lower "
            f"{max_field}",
            max_field,
        )
