"""OpenAI ``POST /v1/completions`` with token-id prompts (vLLM's extensions), streaming or not.

``prompt``: a list of token ids, a list of such lists (one choice per prompt, ``index`` its place),
or text when a tokenizer is configured. Each choice carries ``text`` and ``token_ids`` (the generated
ids, as vLLM returns them with ``return_token_ids``); ``usage`` has
``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache). Streaming:
``data: {chunk}`` lines, each with the new ``text`` and ``token_ids`` of one choice and its
``finish_reason`` on its last chunk; with ``stream_options.include_usage`` every chunk has
``usage: null`` and a last chunk with no choices carries the usage; then ``data: [DONE]``.
``finish_reason``: ``length``, ``stop`` (EOS or a stop token id), ``abort``. A request the engine
failed answers 500 (streaming: a ``data: {"error": ...}`` chunk), naming the prompt.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import Receive

from hybridkv.engine.request import FinishReason, SamplingParams
from hybridkv.server.backend import Finished
from hybridkv.server.generation import Generation, Update
from hybridkv.server.hot import Answer, Json
from hybridkv.server.schemas import (
    ApiError,
    CompletionBody,
    check_fits,
    parse,
    refuse_unsupported,
    sampling,
    token_prompts,
)
from hybridkv.server.sse import Encode, EventStream, sse
from hybridkv.server.state import ServerState
from hybridkv.server.text import TextStream

FIELDS = {"input_ids": "prompt", "max_new_tokens": "max_tokens", "sampling_params": "prompt"}


def finish_reason(result: Finished) -> str:
    if result.finish_reason in (FinishReason.EOS, FinishReason.STOP):
        return "stop"
    return str(result.finish_reason)


def failure(index: int, batch: bool, result: Finished) -> ApiError:
    where = f"prompt[{index}]" if batch else "prompt"
    return ApiError(500, f"{where}: the engine failed this request: {result.error}", where)


def _params(body: CompletionBody, prompts: list[list[int]], context: int) -> list[SamplingParams]:
    """Per prompt; ``max_tokens`` null: up to the context, as vLLM does."""
    refuse_unsupported(
        [
            (body.n != 1, "n", "only one completion per prompt is served; send the prompt n times"),
            (body.best_of not in (None, 1), "best_of", "only 1 is served"),
            (body.echo, "echo", "echoing the prompt is not served"),
            (body.logprobs is not None, "logprobs", "log probabilities are not served"),
            (body.suffix is not None, "suffix", "suffixes are not served"),
            (bool(body.stop), "stop", "stop strings are not served; give stop_token_ids"),
            (bool(body.frequency_penalty), "frequency_penalty", "penalties are not served; give 0"),
            (bool(body.presence_penalty), "presence_penalty", "penalties are not served; give 0"),
            (bool(body.logit_bias), "logit_bias", "logit biases are not served"),
        ]
    )
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    common = dict(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
    )
    out = []
    for prompt in prompts:
        max_new = max(1, context - len(prompt)) if body.max_tokens is None else body.max_tokens
        out.append(sampling(FIELDS, max_new_tokens=max_new, **common))
    return out


async def completions(state: ServerState, raw: bytes, receive: Receive) -> Answer:
    body: CompletionBody = parse(CompletionBody, raw)
    info = state.info
    if body.model is not None and body.model != info.name:
        raise ApiError(404, f"model: {body.model!r} is not served here; this server serves {info.name!r}", "model")
    prompts, batch = token_prompts(body.prompt, "prompt", state.config.tokenizer)
    params = _params(body, prompts, info.max_context)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        check_fits(prompt, p, info, f"prompt[{i}]" if batch else "prompt", "max_tokens")
    cid = state.new_id("cmpl-")
    gen = state.start(prompts, params, body.cache_salt, {cid: list(range(len(prompts)))}, FIELDS, batch, body.stream)
    created = int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": info.name}
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(state, gen, [cid], receive, _encoder(state, gen, head, batch, usage))
    texts = [TextStream(state.config.tokenizer) for _ in prompts]
    async for _ in state.drive(receive, gen, [cid]):
        pass
    choices = []
    for i, got in enumerate(gen.progress):
        assert got.finished is not None
        if got.finished.finish_reason is FinishReason.ERROR:
            raise failure(i, batch, got.finished)
        texts[i].push(got.tokens, final=True)
        choices.append(
            {
                "index": i,
                "text": texts[i].text,
                "token_ids": got.tokens,
                "logprobs": None,
                "finish_reason": finish_reason(got.finished),
            }
        )
    return Json({**head, "choices": choices, "usage": _usage(gen)})


def _usage(gen: Generation) -> dict[str, Any]:
    ended = [p.finished for p in gen.progress if p.finished is not None]
    prompt = sum(len(p) for p in gen.prompts)
    completion = sum(len(p.tokens) for p in gen.progress)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in ended)},
    }


def _encoder(state: ServerState, gen: Generation, head: dict[str, Any], batch: bool, usage: bool) -> Encode:
    texts = [TextStream(state.config.tokenizer) for _ in gen.prompts]
    extra = {"usage": None} if usage else {}

    def encode(updates: list[Update]) -> list[bytes]:
        events = []
        for up in updates:
            ended = up.finished
            if ended is not None and ended.finish_reason is FinishReason.ERROR:
                events.append(sse(failure(up.index, batch, ended).body()))
                continue
            choice = {
                "index": up.index,
                "text": texts[up.index].push(up.new_tokens, final=ended is not None),
                "token_ids": up.new_tokens,
                "logprobs": None,
                "finish_reason": None if ended is None else finish_reason(ended),
            }
            events.append(sse({**head, "choices": [choice], **extra}))
        if gen.done and usage:
            events.append(sse({**head, "choices": [], "usage": _usage(gen)}))
        return events

    return encode
