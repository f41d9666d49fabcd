"""SGLang-native ``POST /generate`` (one prompt or a batch, streaming or not) and ``POST /abort_request``.

``/generate`` takes ``input_ids`` (a list of token ids, or a list of such lists for a batch) or
``text`` (with a tokenizer), ``sampling_params`` (one for all prompts or one per prompt:
``max_new_tokens``, ``temperature``, ``top_p``, ``top_k`` (-1 or 0: off), ``seed``,
``stop_token_ids``, ``ignore_eos``, ``stop`` strings with a tokenizer (``no_stop_trim``: the text keeps the
matched one), ``n`` outputs per prompt (the same for every prompt: SGLang's order, the whole batch once per
sample, a list answer; ``server.choices``)), ``stream``, ``rid`` (ids for ``/abort_request``; one per
prompt in a batch; with ``n`` > 1, ``<rid>_<k>`` for sample ``k``), ``cache_salt`` and SGLang's ``extra_key``
(together, the prefix-cache namespace); every other field of SGLang's ``GenerateReqInput`` is accepted at its
neutral value (``schemas``).
Every answer (each element of a batch) has ``text``,
``output_ids`` and ``meta_info`` {``id``, ``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``finish_reason``, ``e2e_latency``, and from a single-process engine
``cached_tokens_details`` {``device``, ``host``, ``storage``}, from the PD server ``disaggregated``
{``attempts``, ``retractions``, ``transfer_bytes``, ``timing``}}; ``finish_reason`` is SGLang's object
(``{"type": "length", "length": n}``, ``{"type": "stop", "matched": id}`` (a stop string's: the string),
``{"type": "abort", "message": ...}``) and null in a stream until the prompt ended. A stream sends, as SGLang does by
default, the cumulative ``output_ids`` and ``text`` of one prompt per chunk (``index``: its place in
a batch), then ``data: [DONE]``.

``return_logprob`` (with ``top_logprobs_num``, ``return_text_in_logprobs``; each may be one per prompt)
adds ``meta_info`` ``output_token_logprobs`` (``[logprob, id, text]`` per output token) and
``output_top_logprobs``; ``logprob_start_len`` >= 0 adds ``input_token_logprobs`` / ``input_top_logprobs`` of
the prompt from there (its first token's logprob null; the prompt is computed whole, no cache hit); -1, the
default, none (SGLang's -1 scores the last prompt token, which would cost every such request its cache hit).
Log-probabilities are served in one process only: the PD server refuses them.

``/abort_request`` {``rid``} ends the open request (or the one prompt of a batch) with that id, or
every open request with ``abort_all``; a rid that is not open answers 404 naming it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from hybridkv.engine.sched.request import FinishReason, Outcome, SamplingParams
from hybridkv.server.choices import choices_per_prompt, nth
from hybridkv.server.generation import Generation, Progress, Update
from hybridkv.server.hot import Answer, Json
from hybridkv.server.logprob_format import sglang_logprobs
from hybridkv.server.schemas import (
    AbortBody,
    ApiError,
    GenerateBody,
    SglangSampling,
    check_fits,
    ignored_fields,
    parse,
    refuse_unsupported,
    refuse_unsupported_fields,
    request_cache_salt,
    sampling,
    token_prompts,
)
from hybridkv.server.sse import EventStream, sse
from hybridkv.server.state import ServerState
from hybridkv.server.stops import Stops, stop_strings
from hybridkv.server.text import TextTokenizer

if TYPE_CHECKING:
    from hybridkv.engine.disagg.path import PDPath


def _fields(where: str) -> dict[str, str]:
    names = ["max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos"]
    logprobs = {"logprobs": "top_logprobs_num", "prompt_logprobs": "top_logprobs_num"}
    return {"input_ids": "input_ids", "sampling_params": where, **{n: f"{where}.{n}" for n in names}, **logprobs}


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    """A field given once for every prompt or as a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise ApiError(400, f"{name}: {len(value)} values for {n} prompts; give one, or one per prompt", name)
    return value


def _logprob_asks(body: GenerateBody, n: int) -> list[tuple[int | None, int | None]]:
    """Per prompt, what its ``SamplingParams`` ask: ``(logprobs, prompt_logprobs)`` (each None or a top count);
    ``logprob_start_len`` >= 0 asks for the prompt's from there on (-1, the default: none)."""
    out = []
    asks = _per_prompt(body.return_logprob, n, "return_logprob")
    tops = _per_prompt(body.top_logprobs_num, n, "top_logprobs_num")
    starts = _per_prompt(body.logprob_start_len, n, "logprob_start_len")
    for ask, top, start in zip(asks, tops, starts, strict=True):
        out.append((top, top if start >= 0 else None) if ask else (None, None))
    return out


def _params(sp: SglangSampling, where: str, logprobs: tuple[int | None, int | None] = (None, None)) -> SamplingParams:
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
        logprobs=logprobs[0],
        prompt_logprobs=logprobs[1],
    )


def _stops(sp: SglangSampling, where: str, tokenizer: TextTokenizer | None) -> Stops | None:
    """``stop`` (``no_stop_trim``: the matched string stays in the text)."""
    return stop_strings(sp.stop, sp.no_stop_trim, f"{where}.stop", tokenizer)


def _rids(state: ServerState, rid: str | list[str] | None, n: int, batch: bool, samples: int = 1) -> list[str]:
    """One id per output: the client's (one per prompt; with ``samples`` > 1, ``<id>_<k>`` for sample ``k``, in
    the outputs' order), else new ones."""
    if rid is None:
        return [state.new_id() for _ in range(n * samples)]
    if batch != isinstance(rid, list):
        want = "a list of ids, one per prompt" if batch else "one id (a string)"
        raise ApiError(400, f"rid: give {want}", "rid")
    rids = rid if isinstance(rid, list) else [rid]
    if len(rids) != n or len(set(rids)) != n:
        raise ApiError(400, f"rid: {len(rids)} ids ({len(set(rids))} distinct) for {n} prompts", "rid")
    return rids if samples == 1 else [f"{r}_{k}" for k in range(samples) for r in rids]


def _samples(sp: SglangSampling | list[SglangSampling] | None) -> int:
    """``n``: outputs per prompt, the same for every prompt of a batch (as SGLang asks)."""
    given = [s.n for s in sp] if isinstance(sp, list) else [sp.n if sp is not None else 1]
    where = "sampling_params[0].n" if isinstance(sp, list) else "sampling_params.n"
    n = choices_per_prompt(given[0] if given else 1, where)
    if any(other != n for other in given):
        i = next(i for i, other in enumerate(given) if other != n)
        name = f"sampling_params[{i}].n"
        raise ApiError(400, f"{name}: {given[i]}, but sampling_params[0].n is {n}; give every prompt the same n", name)
    return n


def _finish_reason(p: Progress) -> dict[str, Any] | None:
    f = p.finished
    if f is None:
        return None
    if f.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(p.tokens)}
    if f.stop_string is not None:
        return {"type": "stop", "matched": f.stop_string}
    if f.finish_reason in (FinishReason.EOS, FinishReason.STOP):
        return {"type": "stop", "matched": p.tokens[-1] if p.tokens else None}
    return {"type": str(f.finish_reason), "message": f.error}


def _disaggregated(f: Outcome, pd: PDPath) -> dict[str, Any]:
    t = pd.timing
    return {
        "attempts": pd.attempts,
        "retractions": f.retractions,
        "transfer_bytes": pd.transfer_bytes,
        "timing": None
        if t is None
        else {"queue_s": t.queue_s, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s, "decode_s": t.decode_s},
    }


def _answer(gen: Generation, i: int, rid: str, logprobs: _Logprobs | None = None) -> dict[str, Any]:
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
    if f is not None and f.pd is not None:  # a PD request's attempts, bytes and phase times
        meta["disaggregated"] = _disaggregated(f, f.pd)
    if logprobs is not None and logprobs.asked[i]:
        meta.update(logprobs.meta(gen, i))
    return {"text": p.text, "output_ids": p.tokens, "meta_info": meta}


class _Logprobs:
    """What ``/generate`` asked of log-probabilities, and its ``meta_info`` lists for one prompt."""

    def __init__(self, body: GenerateBody, tokenizer: TextTokenizer | None, n: int):
        self.asked = [bool(a) for a in _per_prompt(body.return_logprob, n, "return_logprob")]
        self.starts = _per_prompt(body.logprob_start_len, n, "logprob_start_len")
        self.tokenizer = tokenizer
        self.with_text = body.return_text_in_logprobs

    def meta(self, gen: Generation, i: int) -> dict[str, Any]:
        p, prompt, start = gen.progress[i], gen.prompts[i], self.starts[i]
        out = sglang_logprobs(self.tokenizer, p.tokens, gen.logprobs[i][: len(p.tokens)], self.with_text)
        inp: tuple[list[Any], list[Any]] = ([], [])
        if start >= 0 and p.finished is not None:  # the prompt's come with its end
            entries = [None, *(p.finished.prompt_logprobs or [])][start:]
            inp = sglang_logprobs(self.tokenizer, prompt[start:], entries, self.with_text)
        return {
            "input_token_logprobs": inp[0],
            "output_token_logprobs": out[0],
            "input_top_logprobs": inp[1],
            "output_top_logprobs": out[1],
        }


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
    asks = _logprob_asks(body, len(prompts))
    if isinstance(sp, list):
        if len(sp) != len(prompts):
            raise ApiError(400, f"sampling_params: {len(sp)} given for {len(prompts)} prompts", "sampling_params")
        params = [_params(s, f"sampling_params[{i}]", ask) for i, (s, ask) in enumerate(zip(sp, asks, strict=True))]
        stops = [_stops(s, f"sampling_params[{i}]", state.config.tokenizer) for i, s in enumerate(sp)]
    else:
        params = [_params(sp or SglangSampling(), "sampling_params", ask) for ask in asks]
        stops = [_stops(sp or SglangSampling(), "sampling_params", state.config.tokenizer)] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        where = f"sampling_params[{i}]" if isinstance(sp, list) else "sampling_params"
        check_fits(prompt, p, state.info, f"{field}[{i}]" if batch else field, f"{where}.max_new_tokens")
    samples = _samples(sp)
    if samples > 1:  # SGLang's order: the whole batch once per sample (output k * B + i is prompt i's k-th)
        prompts = prompts * samples
        params = [nth(p, k) for k in range(samples) for p in params]
        stops = stops * samples
    rids = _rids(state, body.rid, len(prompts) // samples, batch, samples)
    fields = _fields("sampling_params") | {"input_ids": field}
    asked = any(p.logprobs is not None for p in params)
    logprobs = _Logprobs(body, state.config.tokenizer, len(prompts)) if asked else None
    ids = {r: [i] for i, r in enumerate(rids)}
    cache_salt = request_cache_salt(body.cache_salt, body.extra_key)
    gen = state.start(prompts, params, cache_salt, ids, fields, batch, body.stream, stops)
    if body.stream:

        def encode(updates: list[Update]) -> list[bytes]:
            events = []
            for up in updates:
                chunk = _answer(gen, up.index, rids[up.index], logprobs)
                if batch or samples > 1:
                    chunk["index"] = up.index
                events.append(sse(chunk))
            return events

        return EventStream(state, gen, rids, receive, encode)
    async for _ in state.drive(receive, gen, rids):
        pass
    for i, got in enumerate(gen.progress):
        if got.finished is not None and got.finished.finish_reason is FinishReason.ERROR:
            where = f"{field}[{i % (len(prompts) // samples)}]" if batch else field
            raise ApiError(500, f"{where}: the engine failed this request: {got.finished.error}", where)
    answers = [_answer(gen, i, rid, logprobs) for i, rid in enumerate(rids)]
    return Json(answers if batch or samples > 1 else answers[0])


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
