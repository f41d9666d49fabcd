"""SGLang-native ``POST /generate`` (one prompt or a batch, streaming or not) and ``POST /abort_request``.

``/generate`` takes ``input_ids`` (a list of token ids, or a list of such lists for a batch) or
``text`` (with a tokenizer), ``sampling_params`` (one for all prompts or one per prompt:
``max_new_tokens``, ``temperature``, ``top_p``, ``top_k`` (-1 or 0: off), ``seed``,
``stop_token_ids``, ``ignore_eos``), ``stream``, ``rid`` (ids for ``/abort_request``; one per
prompt in a batch), ``cache_salt`` and SGLang's ``extra_key`` (together, the prefix-cache namespace);
every other field of SGLang's ``GenerateReqInput`` is accepted at its neutral value (``schemas``).
Every answer (each element of a batch) has ``text``,
``output_ids`` and ``meta_info`` {``id``, ``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``finish_reason``, ``e2e_latency``, and from a single-process engine
``cached_tokens_details`` {``device``, ``host``, ``storage``}, from the PD server ``disaggregated``
{``attempts``, ``retractions``, ``transfer_bytes``, ``timing``}}; ``finish_reason`` is SGLang's object
(``{"type": "length", "length": n}``, ``{"type": "stop", "matched": id}``, ``{"type": "abort",
"message": ...}``) and null in a stream until the prompt ended. A stream sends, as SGLang does by
default, the cumulative ``output_ids`` and ``text`` of one prompt per chunk (``index``: its place in
a batch), then ``data: [DONE]``.

``/abort_request`` {``rid``} ends the open request (or the one prompt of a batch) with that id, or
every open request with ``abort_all``; a rid that is not open answers 404 naming it.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from hybridkv.engine.request import FinishReason, SamplingParams
from hybridkv.server.generation import Generation, Progress, Update
from hybridkv.server.hot import Answer, Json
from hybridkv.server.schemas import (
    AbortBody,
    ApiError,
    GenerateBody,
    SglangSampling,
    cache_namespace,
    check_fits,
    ignored_fields,
    parse,
    refuse_unsupported,
    refuse_unsupported_fields,
    sampling,
    token_prompts,
)
from hybridkv.server.sse import EventStream, sse
from hybridkv.server.state import ServerState
from hybridkv.server.text import TextStream


def _fields(where: str) -> dict[str, str]:
    names = ["max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos"]
    return {"input_ids": "input_ids", "sampling_params": where, **{n: f"{where}.{n}" for n in names}}


def _params(sp: SglangSampling, where: str) -> SamplingParams:
    refuse_unsupported_fields(sp, where)
    return sampling(
        _fields(where),
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=0 if sp.top_k == -1 else sp.top_k,
        seed=sp.seed if sp.seed is not None else sp.sampling_seed,
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        ignore_eos=sp.ignore_eos,
    )


def _rids(state: ServerState, rid: str | list[str] | None, n: int, batch: bool) -> list[str]:
    if rid is None:
        return [state.new_id() for _ in range(n)]
    if batch != isinstance(rid, list):
        want = "a list of ids, one per prompt" if batch else "one id (a string)"
        raise ApiError(400, f"rid: give {want}", "rid")
    rids = rid if isinstance(rid, list) else [rid]
    if len(rids) != n or len(set(rids)) != n:
        raise ApiError(400, f"rid: {len(rids)} ids ({len(set(rids))} distinct) for {n} prompts", "rid")
    return rids


def _finish_reason(p: Progress) -> dict[str, Any] | None:
    f = p.finished
    if f is None:
        return None
    if f.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(p.tokens)}
    if f.finish_reason in (FinishReason.EOS, FinishReason.STOP):
        return {"type": "stop", "matched": p.tokens[-1] if p.tokens else None}
    return {"type": str(f.finish_reason), "message": f.error}


def _answer(gen: Generation, i: int, rid: str, text: TextStream) -> dict[str, Any]:
    p = gen.progress[i]
    f = p.finished
    meta = {
        "id": rid,
        "prompt_tokens": len(gen.prompts[i]),
        "completion_tokens": len(p.tokens),
        "cached_tokens": 0 if f is None else f.cached_tokens,
        "finish_reason": _finish_reason(p),
        "e2e_latency": None if p.finished_at is None else p.finished_at - gen.arrived,
    }
    if f is not None and f.cached_tokens_details is not None:  # where the cached tokens came from
        meta["cached_tokens_details"] = f.cached_tokens_details
    if f is not None and f.disaggregated is not None:  # a PD request's attempts, bytes and phase times
        meta["disaggregated"] = f.disaggregated
    return {"text": text.text, "output_ids": p.tokens, "meta_info": meta}


async def generate(state: ServerState, raw: bytes, receive: Receive) -> Answer:
    body: GenerateBody = parse(GenerateBody, raw)
    state.ignore("/generate", ignored_fields(body))
    both = body.input_ids is not None and body.text is not None
    refuse_unsupported([(both, "text", "give input_ids or text, not both")])
    refuse_unsupported_fields(body)
    field = "text" if body.text is not None else "input_ids"
    prompts, batch = token_prompts(
        body.text if body.text is not None else body.input_ids, field, state.config.tokenizer
    )
    sp = body.sampling_params
    if isinstance(sp, list):
        if len(sp) != len(prompts):
            raise ApiError(400, f"sampling_params: {len(sp)} given for {len(prompts)} prompts", "sampling_params")
        params = [_params(s, f"sampling_params[{i}]") for i, s in enumerate(sp)]
    else:
        one = _params(sp or SglangSampling(), "sampling_params")
        params = [one] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        where = f"sampling_params[{i}]" if isinstance(sp, list) else "sampling_params"
        check_fits(prompt, p, state.info, f"{field}[{i}]" if batch else field, f"{where}.max_new_tokens")
    rids = _rids(state, body.rid, len(prompts), batch)
    fields = _fields("sampling_params") | {"input_ids": field}
    ids = {r: [i] for i, r in enumerate(rids)}
    salt = cache_namespace(body.cache_salt, body.extra_key)
    gen = state.start(prompts, params, salt, ids, fields, batch, body.stream)
    texts = [TextStream(state.config.tokenizer) for _ in prompts]
    if body.stream:

        def encode(updates: list[Update]) -> list[bytes]:
            events = []
            for up in updates:
                texts[up.index].push(up.new_tokens, final=up.finished is not None)
                chunk = _answer(gen, up.index, rids[up.index], texts[up.index])
                if batch:
                    chunk["index"] = up.index
                events.append(sse(chunk))
            return events

        return EventStream(state, gen, rids, receive, encode)
    async for updates in state.drive(receive, gen, rids):
        for up in updates:
            texts[up.index].push(up.new_tokens, final=up.finished is not None)
    for i, got in enumerate(gen.progress):
        if got.finished is not None and got.finished.finish_reason is FinishReason.ERROR:
            where = f"{field}[{i}]" if batch else field
            raise ApiError(500, f"{where}: the engine failed this request: {got.finished.error}", where)
    answers = [_answer(gen, i, rid, texts[i]) for i, rid in enumerate(rids)]
    return Json(answers if batch else answers[0])


async def abort_request(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body: AbortBody = parse(AbortBody, await request.body())
    state.ignore("/abort_request", ignored_fields(body))
    if body.abort_all:
        return JSONResponse({"aborted": state.abort_all("aborted by /abort_request")})
    if body.rid is None:
        raise ApiError(400, "rid: missing; give the id of the request to abort (or abort_all: true)", "rid")
    if not state.abort(body.rid):
        raise ApiError(404, f"rid: no open request has the id {body.rid!r}", "rid")
    return JSONResponse({"aborted": [body.rid]})
