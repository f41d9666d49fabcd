"""The request bodies the server accepts, validated at the edge, and the one error shape it answers.

Every body is parsed by a strict pydantic model (no coercion: ``"16"`` is not an integer, ``true``
is not 1), then turned into ``SamplingParams`` and token prompts; every refusal is an ``ApiError``
whose ``param`` names the field as the client spelt it (``max_tokens``, ``prompt[2][5]``,
``sampling_params.top_p``).

The models know every field of the bodies real clients send: SGLang's ``GenerateReqInput`` and its
``sampling_params``, OpenAI's ``/v1/completions`` with vLLM's and SGLang's extensions. A field no
model knows is accepted and ignored, as vLLM's server does (``ignored_fields`` names them; the
server logs each name once and counts it on ``/metrics``), so a client that sends more than the
server serves still works.

Invariants:
- A known field the server cannot honour (``lora_path``, ``stop_regex``, penalties, images, grammars) is refused
  with a 400 naming it when its value asks for the feature, never silently ignored; its neutral values (null,
  the default, an empty list) pass. Stop strings (``stop``) are served, read by ``stops.stop_strings``.
- A prompt is a non-empty list of integer token ids (or a list of such lists: a batch), or text
  when a tokenizer is configured; ids outside the vocabulary and prompt + new tokens beyond
  the context are refused by ``check_request`` and ``check_fits``, named per endpoint.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
from pydantic import BaseModel, ConfigDict, ValidationError

from hybridkv.engine.sched.request import RequestError, SamplingParams
from hybridkv.server.backend import ModelInfo
from hybridkv.server.text import TextTokenizer


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


Unsupported = tuple[str, tuple[Any, ...], str]
"""A known field the server cannot honour: its name, its neutral values (also inside a list: one per prompt of a
batch), and why it is refused otherwise."""


class _Strict(BaseModel):
    """Strict types; a field no model knows is kept aside (``ignored_fields``), not refused."""

    model_config = ConfigDict(strict=True, extra="allow")
    UNSUPPORTED: ClassVar[list[Unsupported]] = []  # (``refuse_unsupported_fields``)
    NESTED: ClassVar[tuple[str, ...]] = ()  # fields holding bodies of their own (``ignored_fields``)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


_NOT_PD_WORKER = "this server is not an SGLang PD worker (its disaggregation is internal: --disaggregated); give null"
_NO_GRAMMAR = "constrained decoding is not served; give null"
_NO_LORA = "LoRA adapters are not served; give null"

SHARED_UNSUPPORTED: list[Unsupported] = [
    ("lora_path", (None,), _NO_LORA),
    ("session_params", (None,), "sessions are not served; give null"),
    ("return_hidden_states", (False,), "hidden states are not served; give false"),
    ("custom_logit_processor", (None,), "custom logit processors are not served; give null"),
    ("bootstrap_host", (None,), _NOT_PD_WORKER),
    ("bootstrap_port", (None,), _NOT_PD_WORKER),
    ("bootstrap_room", (None,), _NOT_PD_WORKER),
    ("bootstrap_pair_key", (None,), _NOT_PD_WORKER),
    ("data_parallel_rank", (None, 0), "this server is one data-parallel rank, 0; give null or 0"),
    ("priority", (None, 0), "priority scheduling is not served; give null"),
    ("return_entropy", (False,), "entropies are not served; give false"),
    ("return_routed_experts", (False,), "routed experts are not served; give false"),
]


class CompletionBody(_Strict):
    """OpenAI ``/v1/completions`` (null wherever OpenAI's schema allows it), with vLLM's extensions (``top_k``,
    ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``, ``cache_salt``, ...) and SGLang's (``rid``,
    ``extra_key``, ``lora_path``, ``return_cached_tokens_details``, ...)."""

    model: str | None = None
    prompt: Any = None
    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    # vLLM's and SGLang's extensions
    min_p: float | None = 0.0
    min_tokens: int | None = 0
    repetition_penalty: float | None = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    add_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = 1.0
    response_format: Any = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: Any = None
    guided_grammar: str | None = None
    rid: str | None = None
    extra_key: str | None = None
    return_cached_tokens_details: bool = False
    lora_path: Any = None
    session_params: Any = None
    return_hidden_states: bool = False
    custom_logit_processor: str | None = None
    custom_params: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    data_parallel_rank: int | None = None
    priority: int | None = None
    return_entropy: bool = False
    return_routed_experts: bool = False

    NESTED: ClassVar[tuple[str, ...]] = ("stream_options",)
    UNSUPPORTED: ClassVar[list[Unsupported]] = [
        *SHARED_UNSUPPORTED,
        ("best_of", (None, 1), "only 1 is served"),
        ("prompt_logprobs", (None,), "vLLM's prompt_logprobs is not served; give echo: true with logprobs"),
        ("suffix", (None,), "suffixes are not served"),
        ("frequency_penalty", (None, 0.0), "penalties are not served; give 0"),
        ("presence_penalty", (None, 0.0), "penalties are not served; give 0"),
        ("repetition_penalty", (None, 1.0), "penalties are not served; give 1"),
        ("min_p", (None, 0.0), "min_p is not served; give 0"),
        ("min_tokens", (None, 0), "min_tokens is not served; give 0"),
        ("logit_bias", (None, {}), "logit biases are not served"),
        ("truncate_prompt_tokens", (None,), "prompt truncation is not served; send the tokens to keep"),
        ("use_beam_search", (False,), "beam search is not served"),
        ("length_penalty", (None, 1.0), "beam search is not served; give 1"),
        ("response_format", (None, {"type": "text"}), _NO_GRAMMAR),
        ("regex", (None,), _NO_GRAMMAR),
        ("json_schema", (None,), _NO_GRAMMAR),
        ("ebnf", (None,), _NO_GRAMMAR),
        ("guided_json", (None,), _NO_GRAMMAR),
        ("guided_regex", (None,), _NO_GRAMMAR),
        ("guided_choice", (None,), _NO_GRAMMAR),
        ("guided_grammar", (None,), _NO_GRAMMAR),
    ]


class ChatMessage(_Strict):
    """One message of an OpenAI chat: ``content`` text, or a list of ``{"type": "text", "text": ...}`` parts."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None


class ChatBody(_Strict):
    """OpenAI ``/v1/chat/completions`` (null wherever OpenAI's schema allows it), with vLLM's extensions (``top_k``,
    ``stop_token_ids``, ``ignore_eos``, ``cache_salt``, ...) and SGLang's (``rid``, ``extra_key``, ...)."""

    model: str | None = None
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    logprobs: bool | None = False
    top_logprobs: int | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    cache_salt: str | None = None
    rid: str | None = None
    extra_key: str | None = None
    return_cached_tokens_details: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    lora_path: Any = None
    min_p: float | None = 0.0
    min_tokens: int | None = 0
    include_stop_str_in_output: bool = False

    NESTED: ClassVar[tuple[str, ...]] = ("stream_options",)
    UNSUPPORTED: ClassVar[list[Unsupported]] = [
        ("lora_path", (None,), _NO_LORA),
        ("frequency_penalty", (None, 0.0), "penalties are not served; give 0"),
        ("presence_penalty", (None, 0.0), "penalties are not served; give 0"),
        ("repetition_penalty", (None, 1.0), "penalties are not served; give 1"),
        ("min_p", (None, 0.0), "min_p is not served; give 0"),
        ("min_tokens", (None, 0), "min_tokens is not served; give 0"),
        ("logit_bias", (None, {}), "logit biases are not served"),
        ("tools", (None, ()), "tool calls are not served; give null"),
        ("tool_choice", (None, "none"), "tool calls are not served; give null"),
        ("response_format", (None, {"type": "text"}), _NO_GRAMMAR),
        ("chat_template_kwargs", (None, {}), "chat template arguments are not served; give null"),
        ("add_generation_prompt", (True,), "the chat is always rendered for the assistant's turn"),
        ("continue_final_message", (False,), "continuing the final message is not served"),
    ]


class SglangSampling(_Strict):
    """SGLang's ``sampling_params`` (``SamplingParams.__init__``), plus ``seed``."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    sampling_seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None
    n: int = 1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None  # the server's --stream-interval rules every stream
    logit_bias: dict[str, float] | None = None

    UNSUPPORTED: ClassVar[list[Unsupported]] = [
        ("stop_regex", (None, "", ()), "stop patterns are not served; give stop strings (stop) or stop_token_ids"),
        ("min_p", (0.0,), "min_p is not served; give 0"),
        ("frequency_penalty", (0.0,), "penalties are not served; give 0"),
        ("presence_penalty", (0.0,), "penalties are not served; give 0"),
        ("repetition_penalty", (1.0,), "penalties are not served; give 1"),
        ("min_new_tokens", (0,), "min_new_tokens is not served; give 0"),
        ("regex", (None,), _NO_GRAMMAR),
        ("ebnf", (None,), _NO_GRAMMAR),
        ("json_schema", (None,), _NO_GRAMMAR),
        ("structural_tag", (None,), _NO_GRAMMAR),
        ("logit_bias", (None, {}), "logit biases are not served"),
    ]


class GenerateBody(_Strict):
    """SGLang-native ``/generate``: the fields of SGLang's ``GenerateReqInput``, plus ``cache_salt``. Fields that
    may hold one value per prompt of a batch take a list too."""

    input_ids: Any = None
    text: Any = None
    sampling_params: SglangSampling | list[SglangSampling] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    cache_salt: str | None = None
    extra_key: str | None = None  # SGLang's cache namespace: joins cache_salt
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: Any = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: Any = None
    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    return_hidden_states: bool | list[bool] = False
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    data_parallel_rank: int | None = None
    routed_dp_rank: int | None = None
    background: bool = False
    conversation_id: str | None = None
    priority: int | None = None
    no_logs: bool = False
    custom_labels: dict[str, Any] | None = None
    return_bytes: bool = False
    return_entropy: bool = False
    return_routed_experts: bool = False
    require_reasoning: bool = False

    NESTED: ClassVar[tuple[str, ...]] = ("sampling_params",)
    UNSUPPORTED: ClassVar[list[Unsupported]] = [
        *SHARED_UNSUPPORTED,
        ("input_embeds", (None,), "input embeddings are not served; give input_ids or text"),
        ("image_data", (None,), "images are not served (a text-only model); give null"),
        ("video_data", (None,), "videos are not served (a text-only model); give null"),
        ("audio_data", (None,), "audio is not served (a text-only model); give null"),
        ("modalities", (None,), "only text is served; give null"),
        ("token_ids_logprob", (None,), "log probabilities of chosen ids are not served; give top_logprobs_num"),
        ("lora_id", (None,), _NO_LORA),
        ("routed_dp_rank", (None, 0), "this server is one data-parallel rank, 0; give null or 0"),
        ("background", (False,), "background requests are not served; give false"),
        ("return_bytes", (False,), "byte outputs are not served; give false"),
        ("require_reasoning", (False,), "reasoning parsers are not served; give false"),
    ]


class AbortBody(_Strict):
    rid: str | None = None
    abort_all: bool = False


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` asks for nothing: one of ``neutral`` (type-exact: ``0`` is not ``False``), an empty list,
    or a list (one per prompt) of such values."""
    if isinstance(value, list):
        return all(_neutral(v, neutral) for v in value)
    return any(type(value) is type(n) and value == n for n in neutral)


def refuse_unsupported_fields(body: _Strict, where: str = "") -> None:
    """400 naming the first known field of ``body`` (``where``: its place, e.g. ``sampling_params[1]``) whose value
    asks for what the server cannot honour. Only fields the client sent are looked at (every default is neutral)."""
    sent = body.model_fields_set
    for field, neutral, why in type(body).UNSUPPORTED:
        if field in sent and not _neutral(getattr(body, field), neutral):
            name = f"{where}.{field}" if where else field
            raise ApiError(400, f"{name}: {why}", name)


def ignored_fields(body: _Strict, where: str = "") -> list[str]:
    """The fields of ``body`` and of the bodies nested in it (``NESTED``) that no model knows (a batch's
    ``sampling_params`` named once, without an index): ``["max_tokenz", "sampling_params.colour"]``."""
    names = [f"{where}{name}" for name in body.__pydantic_extra__ or ()]
    for field in type(body).NESTED:
        value = getattr(body, field)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, _Strict):
                names += [n for n in ignored_fields(item, f"{where}{field}.") if n not in names]
    return names


def request_cache_salt(cache_salt: str | None, extra_key: str | None) -> str | None:
    """The prefix-cache namespace of a request: vLLM's ``cache_salt`` and SGLang's ``extra_key`` together (a
    request with either shares cached prefixes only with requests giving the same pair)."""
    if extra_key is None:
        return cache_salt
    return msgspec.json.encode([cache_salt, extra_key]).decode()


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


def token_prompts(value: Any, field: str, tokenizer: TextTokenizer | None) -> tuple[list[list[int]], bool]:
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
