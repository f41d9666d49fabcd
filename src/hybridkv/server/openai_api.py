"""OpenAI ``POST /v1/completions`` with token-id prompts (vLLM's extensions), streaming or not.

``prompt``: a list of token ids, a list of such lists (one choice per prompt, ``index`` its place),
or text when a tokenizer is configured. Each choice carries ``text`` and ``token_ids`` (the generated
ids, as vLLM returns them with ``return_token_ids``); ``usage`` has
``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache). Streaming:
``data: {chunk}`` lines, each with the new ``text`` and ``token_ids`` of one choice and its
``finish_reason`` on its last chunk; with ``stream_options.include_usage`` every chunk has
``usage: null`` and a last chunk with no choices carries the usage; then ``data: [DONE]``.
``finish_reason``: ``length``, ``stop`` (EOS, a stop token id or a stop string), ``abort``. ``stop`` (a string or
a list of up to 16, ``stops``; with a tokenizer) ends a choice where its text first contains one: the text ends
right before it (vLLM's ``include_stop_str_in_output``: after it), ``token_ids`` and ``usage`` count the tokens
up to the one that completed it, and a stream never sends text past it (a tail that may begin one waits).
A request the engine failed answers 500 (streaming: a ``data: {"error": ...}`` chunk), naming the prompt. With SGLang's
``return_cached_tokens_details: true`` the answer (streaming: each choice's last chunk and the usage
chunk) carries ``sglext.cached_tokens_details`` {``device``, ``host``, ``storage``}: where the cached
prompt tokens came from. ``logprobs`` n (0-20): each choice's ``logprobs`` object (``logprob_format``: each
token's log-probability and the n most likely tokens', streamed per chunk too); ``echo`` puts the prompt
before the text (and, with ``logprobs``, the prompt tokens' figures first, the first one null: the prompt is
then computed whole, no cache hit); ``max_tokens`` 0 with ``echo`` scores the prompt alone, as evaluation
harnesses ask (not streamed). ``n`` (1-64) choices per prompt: choice ``i * n + j`` is prompt ``i``'s
``j``-th (a given ``seed`` plus ``j``); its copies find the prompt in the prefix cache, and ``usage`` counts
each prompt once. SGLang's ``rid`` names the request (its ``id``; ``/abort_request`` takes it)
and ``extra_key`` joins ``cache_salt`` as the prefix-cache namespace.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import Receive

from hybridkv.engine.logprobs import TokenLogprob
from hybridkv.engine.sched.request import FinishReason, Outcome, SamplingParams
from hybridkv.server.choices import choices_per_prompt, nth
from hybridkv.server.generation import Generation, Update
from hybridkv.server.hot import Answer, Json
from hybridkv.server.logprob_format import openai_logprobs
from hybridkv.server.schemas import (
    ApiError,
    CompletionBody,
    check_fits,
    ignored_fields,
    parse,
    refuse_unsupported_fields,
    request_cache_salt,
    sampling,
    token_prompts,
)
from hybridkv.server.sse import Encode, EventStream, sse
from hybridkv.server.state import ServerState
from hybridkv.server.stops import stop_strings

"""Choices per prompt (``n``), at most."""
FIELDS = {
    "input_ids": "prompt",
    "max_new_tokens": "max_tokens",
    "sampling_params": "prompt",
    "prompt_logprobs": "logprobs",
}


def finish_reason(result: Outcome) -> str:
    if result.finish_reason in (FinishReason.EOS, FinishReason.STOP):
        return "stop"
    return str(result.finish_reason)


def failure(index: int, batch: bool, result: Outcome) -> ApiError:
    where = f"prompt[{index}]" if batch else "prompt"
    return ApiError(500, f"{where}: the engine failed this request: {result.error}", where)


def _params(body: CompletionBody, prompts: list[list[int]], context: int) -> list[SamplingParams]:
    """Per prompt; ``max_tokens`` null: up to the context, as vLLM does; 0 (only with ``echo``: the prompt's
    log-probabilities alone) computes one token that the answer leaves out."""
    refuse_unsupported_fields(body)
    echo = bool(body.echo)
    if body.max_tokens == 0 and not echo:
        raise ApiError(
            400, "max_tokens: 0 asks for nothing; give >= 1, or echo: true to score the prompt", "max_tokens"
        )
    if echo and body.stream:
        raise ApiError(400, "echo: not served with stream: true; send it without streaming", "echo")
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    common = dict(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if echo else None,
    )
    out = []
    for prompt in prompts:
        max_new = max(1, context - len(prompt)) if body.max_tokens is None else max(1, body.max_tokens)
        out.append(sampling(FIELDS, max_new_tokens=max_new, **common))
    return out


async def completions(state: ServerState, raw: bytes, receive: Receive) -> Answer:
    body: CompletionBody = parse(CompletionBody, raw)
    state.ignore("/v1/completions", ignored_fields(body))
    info = state.info
    state.check_model(body.model)
    tokenizer = state.config.tokenizer
    prompts, batch = token_prompts(body.prompt, "prompt", tokenizer)
    params = _params(body, prompts, info.max_context)
    stops = stop_strings(body.stop, body.include_stop_str_in_output, "stop", tokenizer)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        check_fits(prompt, p, info, f"prompt[{i}]" if batch else "prompt", "max_tokens")
    n = choices_per_prompt(body.n)
    if n > 1:  # choice i * n + j of prompt i: the copies after the first find its prompt in the prefix cache
        prompts = [prompt for prompt in prompts for _ in range(n)]
        params = [nth(p, j) for p in params for j in range(n)]
    cid = body.rid if body.rid is not None else state.new_id("cmpl-")  # SGLang's rid: /abort_request finds it
    cache_salt = request_cache_salt(body.cache_salt, body.extra_key)
    stream = bool(body.stream)
    gen = state.start(
        prompts, params, cache_salt, {cid: list(range(len(prompts)))}, FIELDS, batch, stream, [stops] * len(prompts)
    )
    created = int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": info.name}
    if stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        asked = body.logprobs is not None
        encode = _encoder(state, gen, head, batch, n, usage, body.return_cached_tokens_details, asked)
        return EventStream(state, gen, [cid], receive, encode)
    async for _ in state.drive(receive, gen, [cid]):
        pass
    choices = []
    for i, got in enumerate(gen.progress):
        assert got.finished is not None
        if got.finished.finish_reason is FinishReason.ERROR:
            raise failure(i // n, batch, got.finished)
        if body.max_tokens == 0:  # the prompt alone: the token computed for it is not part of the answer
            got.tokens.clear()
            got.text = ""
            gen.logprobs[i].clear()
        text, logprobs = got.text, None
        if body.echo:
            prompt_text = "" if tokenizer is None else tokenizer.decode(gen.prompts[i])
            text = prompt_text + text
        if body.logprobs is not None:
            entries: list[TokenLogprob | None] = list(gen.logprobs[i])
            ids = got.tokens
            if body.echo:
                ids = gen.prompts[i] + ids
                entries = [None, *(got.finished.prompt_logprobs or []), *entries]
            logprobs = openai_logprobs(tokenizer, ids, entries)
        choices.append(
            {
                "index": i,
                "text": text,
                "token_ids": got.tokens,
                "logprobs": logprobs,
                "finish_reason": finish_reason(got.finished) if body.max_tokens != 0 else "length",
            }
        )
    answer = {**head, "choices": choices, "usage": openai_usage(gen, n)}
    if body.return_cached_tokens_details:
        answer["sglext"] = sglext([p.finished for p in gen.progress])
    return Json(answer)


def openai_usage(gen: Generation, n: int = 1) -> dict[str, Any]:
    """Each prompt counted once (``n`` choices of it: its first choice's prompt figures)."""
    ended = [p.finished for p in gen.progress[::n] if p.finished is not None]
    prompt = sum(len(p) for p in gen.prompts[::n])
    completion = sum(len(p.tokens) for p in gen.progress)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in ended)},
    }


def sglext(ended: list[Outcome | None]) -> dict[str, Any]:
    """SGLang's extension object: where the cached prompt tokens came from, summed over the prompts ended."""
    total = dict.fromkeys(("device", "host", "storage"), 0)
    for f in ended:
        if f is None:
            continue
        for where, n in (f.cached_tokens_details or {"device": f.cached_tokens}).items():
            total[where] = total.get(where, 0) + n
    return {"cached_tokens_details": total}


def _encoder(
    state: ServerState,
    gen: Generation,
    head: dict[str, Any],
    batch: bool,
    n: int,
    usage: bool,
    details: bool,
    logprobs: bool,
) -> Encode:
    """``details``: each choice's last chunk (and the usage chunk) carries ``sglext``; ``logprobs``: each chunk its
    tokens' log-probabilities (``text_offset`` counted over the choice's text so far)."""
    tokenizer = state.config.tokenizer
    offsets = [0] * len(gen.prompts)
    extra = {"usage": None} if usage else {}

    def encode(updates: list[Update]) -> list[bytes]:
        events = []
        for up in updates:
            ended = up.finished
            if ended is not None and ended.finish_reason is FinishReason.ERROR:
                events.append(sse(failure(up.index // n, batch, ended).body()))
                continue
            chunk_logprobs = None
            if logprobs:
                i, done = up.index, len(gen.progress[up.index].tokens)
                entries = gen.logprobs[i][done - len(up.new_tokens) : done]
                chunk_logprobs = openai_logprobs(tokenizer, up.new_tokens, entries, offsets[i])
                offsets[i] += sum(len(t) for t in chunk_logprobs["tokens"])
            choice = {
                "index": up.index,
                "text": up.text,
                "token_ids": up.new_tokens,
                "logprobs": chunk_logprobs,
                "finish_reason": None if ended is None else finish_reason(ended),
            }
            ext = {"sglext": sglext([ended])} if details and ended is not None else {}
            events.append(sse({**head, "choices": [choice], **extra, **ext}))
        if gen.done and usage:
            ext = {"sglext": sglext([p.finished for p in gen.progress])} if details else {}
            events.append(sse({**head, "choices": [], "usage": openai_usage(gen, n), **ext}))
        return events

    return encode
