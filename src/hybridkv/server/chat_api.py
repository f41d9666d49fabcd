"""OpenAI ``POST /v1/chat/completions``, streamed or not, over the tokenizer's chat template.

``messages`` (roles ``system``, ``developer``, ``user``, ``assistant``, ``tool``; ``content`` text or a list of
``{"type": "text", "text": ...}`` parts) are rendered by the server's tokenizer (``TextTokenizer.render_chat``:
a saved tokenizer's own chat template, or the byte tokenizer's built-in one) and served like one
``/v1/completions`` prompt: the same sampling fields, ``max_completion_tokens`` (or ``max_tokens``; null: up to
the context), ``logprobs`` with ``top_logprobs`` (0-20), ``usage`` with ``prompt_tokens_details.cached_tokens``,
SGLang's ``return_cached_tokens_details`` (``sglext``), ``rid`` and ``extra_key``, and ``stop`` strings as
``/v1/completions`` serves them (``include_stop_str_in_output`` too), and ``n`` choices (``server.choices``;
the prompt counted once in ``usage``). The answer is a ``chat.completion`` whose choice ``j``'s ``message`` is
the assistant's text; streamed, ``chat.completion.chunk`` lines: per choice, the first ``delta`` carries the
role, the next ones the text as it comes, the last the ``finish_reason`` (and ``sglext`` where it was asked for;
with ``stream_options.include_usage`` a last chunk with no choices carries the usage), then ``data: [DONE]``.

Refusals (400 naming the field): a server without a tokenizer, a tokenizer without a chat template, a message
with an unknown role or a non-text part, and every known field asking for what is not served (tools, penalties,
grammars).
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import Receive

from hybridkv.engine.logprobs import TokenLogprob
from hybridkv.engine.sched.request import FinishReason, SamplingParams
from hybridkv.server.choices import choices_per_prompt, nth
from hybridkv.server.generation import Generation, Update
from hybridkv.server.hot import Answer, Json
from hybridkv.server.openai_api import failure, finish_reason, openai_usage, sglext
from hybridkv.server.schemas import (
    ApiError,
    ChatBody,
    ChatMessage,
    check_fits,
    ignored_fields,
    parse,
    refuse_unsupported_fields,
    request_cache_salt,
    sampling,
)
from hybridkv.server.sse import Encode, EventStream, sse
from hybridkv.server.state import ServerState
from hybridkv.server.stops import stop_strings
from hybridkv.server.text import ChatTemplateMissing, TextTokenizer

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
FIELDS = {
    "input_ids": "messages",
    "max_new_tokens": "max_completion_tokens",
    "sampling_params": "messages",
    "logprobs": "top_logprobs",
}


def _texts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The conversation as ``{"role", "content"}`` texts (a 400 naming the first bad message or part)."""
    if not messages:
        raise ApiError(400, "messages: empty; give at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ApiError(
                400, f"messages[{i}].role: {m.role!r}; give one of {', '.join(sorted(ROLES))}", f"messages[{i}].role"
            )
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    where = f"messages[{i}].content[{j}]"
                    raise ApiError(400, f"{where}: only {{'type': 'text', 'text': ...}} parts are served", where)
                parts.append(part["text"])
            content = "".join(parts)
        out.append({"role": m.role, "content": content or ""})
    return out


def _prompt(body: ChatBody, tokenizer: TextTokenizer | None) -> list[int]:
    if tokenizer is None:
        raise ApiError(
            400,
            "messages: a chat needs a tokenizer with a chat template and this server has none; "
            "start it with --tokenizer DIR (or a --model directory that holds one)",
            "messages",
        )
    try:
        return tokenizer.render_chat(_texts(body.messages))
    except ChatTemplateMissing as exc:
        raise ApiError(400, f"messages: {exc}", "messages") from None


def _params(body: ChatBody, prompt: list[int], context: int) -> SamplingParams:
    refuse_unsupported_fields(body)
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return sampling(
        FIELDS,
        max_new_tokens=max(1, context - len(prompt)) if limit is None else limit,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k in (None, -1) else body.top_k,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=(top or 0) if body.logprobs else None,
    )


def _content_logprobs(tokenizer: TextTokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat's ``logprobs`` object: per token its text, log-probability, UTF-8 bytes and most likely tokens."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]}


async def chat_completions(state: ServerState, raw: bytes, receive: Receive) -> Answer:
    body: ChatBody = parse(ChatBody, raw)
    state.ignore("/v1/chat/completions", ignored_fields(body))
    info, tokenizer = state.info, state.config.tokenizer
    state.check_model(body.model)
    prompt = _prompt(body, tokenizer)
    assert tokenizer is not None
    params = _params(body, prompt, info.max_context)
    check_fits(prompt, params, info, "messages", "max_completion_tokens")
    stops = stop_strings(body.stop, body.include_stop_str_in_output, "stop", tokenizer)
    n = choices_per_prompt(body.n)  # choice j: a copy of the prompt (found in the prefix cache), its seed moved by j
    cid = body.rid if body.rid is not None else state.new_id("chatcmpl-")
    stream = bool(body.stream)
    cache_salt = request_cache_salt(body.cache_salt, body.extra_key)
    copies = [nth(params, j) for j in range(n)]
    gen = state.start([prompt] * n, copies, cache_salt, {cid: list(range(n))}, FIELDS, False, stream, [stops] * n)
    head = {"id": cid, "created": int(time.time()), "model": info.name}
    asked = body.logprobs is True
    if stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(state, gen, [cid], receive, _encoder(tokenizer, gen, head, usage, asked, body, n))
    async for _ in state.drive(receive, gen, [cid]):
        pass
    choices = []
    for j, got in enumerate(gen.progress):
        assert got.finished is not None
        if got.finished.finish_reason is FinishReason.ERROR:
            raise failure(0, False, got.finished)
        choices.append(
            {
                "index": j,
                "message": {"role": "assistant", "content": got.text},
                "logprobs": _content_logprobs(tokenizer, gen.logprobs[j]) if asked else None,
                "finish_reason": finish_reason(got.finished),
            }
        )
    answer = {**head, "object": "chat.completion", "choices": choices, "usage": openai_usage(gen, n)}
    if body.return_cached_tokens_details:
        answer["sglext"] = sglext([p.finished for p in gen.progress])
    return Json(answer)


def _encoder(
    tokenizer: TextTokenizer, gen: Generation, head: dict[str, Any], usage: bool, asked: bool, body: ChatBody, n: int
) -> Encode:
    chunk_head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if usage else {}
    started = [False] * n
    sent = [0] * n  # tokens of each choice whose log-probabilities went out

    def choice(j: int, delta: dict[str, Any], reason: str | None, logprobs: Any = None, ext: Any = None) -> bytes:
        body_ = {"index": j, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse({**chunk_head, "choices": [body_], **extra, **(ext or {})})

    def encode(updates: list[Update]) -> list[bytes]:
        events = []
        for up in updates:
            j = up.index
            if not started[j]:
                started[j] = True
                events.append(choice(j, {"role": "assistant", "content": ""}, None))
            ended = up.finished
            if ended is not None and ended.finish_reason is FinishReason.ERROR:
                events.append(sse(failure(0, False, ended).body()))
                continue
            delta = up.text
            logprobs = None
            if asked and up.new_tokens:
                first, sent[j] = sent[j], sent[j] + len(up.new_tokens)
                logprobs = _content_logprobs(tokenizer, gen.logprobs[j][first : sent[j]])
            reason = None if ended is None else finish_reason(ended)
            # SGLang's clients read the cached tokens off a choice's last chunk (they ask for no usage chunk)
            ext = {"sglext": sglext([ended])} if body.return_cached_tokens_details and ended is not None else None
            if delta or reason is not None or logprobs is not None:
                events.append(choice(j, {"content": delta} if delta or logprobs else {}, reason, logprobs, ext))
        if gen.done and usage:
            ext = {"sglext": sglext([p.finished for p in gen.progress])} if body.return_cached_tokens_details else {}
            events.append(sse({**chunk_head, "choices": [], "usage": openai_usage(gen, n), **ext}))
        return events

    return encode
