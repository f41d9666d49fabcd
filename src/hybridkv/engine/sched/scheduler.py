"""Scheduler: continuous batching of chunked prefills and decodes over the prefix cache, in three roles.

One scheduler serves every engine: ``Role.WHOLE`` (prefill and decode in one engine),
``Role.PREFILL`` (a disaggregated prefill engine: batches prompt chunks of several requests;
when a request's prompt is computed its first token is chosen and the request is *handed
off* (``HANDED_OFF``): its memory stays held until its sender finished, then ``release_sent``
caches the prompt and releases the rest) and ``Role.DECODE`` (a disaggregated decode engine:
``reserve`` holds memory for a request's prompt while its KV arrives, ``RECEIVING``; ``received``
makes it a running request that decodes like any other; ``abandon`` and ``drop`` give up one).

Every step runs all running requests together: each feeds its next uncomputed tokens (up to
``chunk_size`` while prefilling, one while decoding); the prefilling ones within ``max_step_tokens``, the decoding
ones (one token left to compute) on top of it, so decodes never shrink a step's prompt work (SGLang's
``max_prefill_tokens``: a burst of prompts reaches its first tokens a step sooner); a chunk that
would pass a position where the checkpoint placement wants the state stored
(``Request.wanted``) ends there instead. Waiting requests are admitted while their cache
hit's state slot and the pages of their first chunk fit (``RequestKV.admit``: computation
starts at the hit's end; the first request of an empty engine always starts). A waiting request
that shares a prefix with a prompt still being prefilled waits (others behind it are admitted)
until that prefix is computed and cached, so a step never computes the same tokens twice
(``_waits_for_prefill``; at most ``WAITING_SCAN`` wait ahead of the one admitted); on a model with
recurrent layers the one in prefill stores its state where the waiting one branches off (when the
placement stores branch points), so the waiting one hits the whole shared prefix. Memory for a
step comes from one ``RequestKV.allocate`` call to absolute lengths; when any rank is
refused (the cache had nothing left to evict) the most recently admitted request is retracted
on every rank: it frees its KV (what it inserted stays cached), returns to the front of
the queue (counted as a retraction when it held memory) and, when admitted again, matches again
and recomputes only what the cache does not hold (its output stays exact). On a decode engine a
retracted request is prefilled again locally from its prompt and the tokens it already has. A
request that cannot fit even alone fails with an error naming the budget; one that waits only
for memory held outside the batch (being sent or received) waits.

Invariants:
- A request's ``status`` says where it is: ``WAITING`` in ``waiting``, ``RUNNING`` in ``running``,
  ``HELD`` (handed off, receiving, abandoned) in neither; ``requests`` indexes all of them until they end.
- A request's ``computed`` tokens are exactly the ones whose K/V and state are in memory after a
  step; logits are taken only when a step's span reaches the end of its known tokens.
- A request ends exactly once (``finished`` collects it): ``length``, ``eos``, ``stop`` (its
  ``SamplingParams``), ``abort``, or ``error`` (including non-finite logits); a handed-off request ends when
  its sender is done (``release_sent``), a dropped one silently. Ended, waiting and retracted requests hold no
  KV (``RequestKV.free`` once per admission); held ones hold theirs.
- Every decision that depends on a rank's memory goes through ``agree`` (``engine.sched.agreement``),
  so every rank of a multi-process engine runs the same schedule.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum

import torch

from hybridkv.engine.forward.batch import ForwardBatch
from hybridkv.engine.logprobs import TokenLogprob, token_logprobs
from hybridkv.engine.sched.agreement import ALONE, Agreement
from hybridkv.engine.sched.kv import Admission, Budget, RequestKV, StepRows
from hybridkv.engine.sched.request import HELD, FinishReason, Request, RequestStatus
from hybridkv.engine.sched.sampling import NON_FINITE, choose_tokens
from hybridkv.memory import OutOfMemory


class Role(Enum):
    WHOLE = "whole"
    PREFILL = "prefill"
    DECODE = "decode"


STEP_CHUNKS = 16
"""An engine step's token budget when none is given: this many prefill chunks (``step_budget``)."""

WAITING_SCAN = 64
"""Waiting requests that may wait for a running prefill ahead of the one admitted (bounds a step's scan)."""


def step_budget(chunk_size: int, max_step_tokens: int | None) -> int:
    """The tokens one step may compute: ``max_step_tokens``, or ``STEP_CHUNKS`` chunks when it is None."""
    return STEP_CHUNKS * chunk_size if max_step_tokens is None else max_step_tokens


@dataclass(frozen=True)
class Step:
    reqs: list[Request]
    spans: list[int]
    batch: ForwardBatch
    ending: list[int]
    """Rows whose span reaches the end of their known tokens: the step chooses their next token."""


def choose_step_tokens(step: Step, logits: torch.Tensor) -> list[int | None]:
    """The token each request of ``step`` gets from ``logits`` (the rows of ``step.ending``; None
    mid-prefill, ``NON_FINITE`` where the logits are broken). ``logits`` holds one row per request
    of the step, or one per ending row (``rows_only``)."""
    rows = step.ending
    out: list[int | None] = [None] * len(step.reqs)
    if not rows:
        return out
    picked = logits if logits.shape[0] == len(rows) else logits[rows]  # every row ends, or only ending rows came
    reqs = [step.reqs[i] for i in rows]
    for i, token in zip(
        rows, choose_tokens(picked, [r.params for r in reqs], [len(r.tokens) for r in reqs]), strict=True
    ):
        out[i] = token
    return out


def step_logprobs(step: Step, logits: torch.Tensor, tokens: list[int | None]) -> list[TokenLogprob | None]:
    """The log-probabilities of the tokens ``choose_step_tokens`` chose, for the requests that ask
    (``params.logprobs``); None for the others, mid-prefill and where the logits are broken."""
    out: list[TokenLogprob | None] = [None] * len(step.reqs)
    asking = [
        (i, j)
        for j, i in enumerate(step.ending)
        if step.reqs[i].params.logprobs is not None and tokens[i] not in (None, NON_FINITE)
    ]
    if not asking:
        return out
    only_ending = logits.shape[0] == len(step.ending)  # as in choose_step_tokens
    rows = [j if only_ending else i for i, j in asking]
    tops = [step.reqs[i].params.logprobs or 0 for i, _ in asking]
    chosen = token_logprobs(logits, rows, [tokens[i] or 0 for i, _ in asking], tops)
    for (i, _), logprob in zip(asking, chosen, strict=True):
        out[i] = logprob
    return out


def shared_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit`` (compared a block at a time)."""
    n, at, block = min(len(a), len(b), limit), 0, 64
    while at < n and a[at : at + block] == b[at : at + block]:
        at += block
    if at >= n:
        return n
    while at < n and a[at] == b[at]:
        at += 1
    return at


def _non_finite(req: Request) -> str:
    return (
        f"request {req.rid}: the logits at position {len(req.tokens)} are not finite (NaN or inf); "
        "the model's weights or activations are broken"
    )


def _cached_end(req: Request, page: int) -> int:
    """Where the cache's copy of ``req``'s computed tokens ends (whole pages; checkpoints sit on page bounds)."""
    return req.computed - req.computed % page


def _prefilling(req: Request, page: int) -> bool:
    """A page or more of ``req``'s prompt is not cached yet: a waiting request sharing it may wait for it."""
    return _cached_end(req, page) + page <= len(req.prompt)


class Scheduler:
    def __init__(
        self,
        kv: RequestKV,
        chunk_size: int,
        max_running: int,
        max_step_tokens: int,
        role: Role = Role.WHOLE,
        agree: Agreement = ALONE,
    ):
        if chunk_size < 1 or max_running < 1 or max_step_tokens < 1:
            raise ValueError("chunk_size, max_running and max_step_tokens must be >= 1")
        self.kv = kv
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.role = role
        self.agree = agree
        self.requests: dict[Hashable, Request] = {}
        """Every request until it ends, by id: waiting, running or held (``HELD``: handed off or receiving)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        """Requests that ended since the caller last took them (``take_finished``)."""
        self.retractions = 0
        self.prefix_waits = 0
        """Times a waiting request let others pass to wait for a running prefill of its prefix (once per step)."""

    # --- requests in and out ----------------------------------------------------------

    def add(self, req: Request) -> None:
        self.kv.plan(req)  # with tiers: its restore is planned now
        self.requests[req.rid] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def held(self) -> list[Request]:
        """Requests holding memory outside the batch (``HELD``: handed off, receiving, abandoned)."""
        return [r for r in self.requests.values() if r.status in HELD]

    def holds(self, rid: Hashable) -> bool:
        """Request ``rid`` holds memory outside the batch."""
        req = self.requests.get(rid)
        return req is not None and req.status in HELD

    def take_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    def abort(self, rid: Hashable, reason: str = "aborted") -> Request | None:
        """End a waiting or running request now (its memory released; what it cached stays).
        None when no such request waits or runs (ended, unknown, or held outside the batch)."""
        req = self.requests.get(rid)
        if req is None or req.status not in (RequestStatus.WAITING, RequestStatus.RUNNING):
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self.kv.free(req, cache=False)  # a waiting request: a planned restore's pins
        return self._end(req, FinishReason.ABORT, reason)

    def _end(self, req: Request, reason: FinishReason, error: str | None = None) -> Request:
        req.finish_reason, req.error = reason, error
        return self._finished(req)

    def _finished(self, req: Request) -> Request:
        req.status = RequestStatus.FINISHED
        del self.requests[req.rid]
        self.finished.append(req)
        return req

    # --- prefill role: handed-off requests ------------------------------------------------

    def release_sent(self, rid: Hashable) -> Request:
        """Its sender finished (either way): cache the computed prompt and release the rest."""
        req = self.requests.pop(rid)
        assert req.status is RequestStatus.HANDED_OFF
        self.kv.free(req, cache=True)
        req.status = RequestStatus.FINISHED
        return req

    # --- decode role: receiving requests -----------------------------------------------

    def reserve(self, req: Request) -> bool:
        """Hold memory for ``req``'s prompt while its KV arrives, on every rank or on none (False:
        nothing held; it fits only once other requests let go, or never: ``alone_in_memory``)."""
        req.status = RequestStatus.RECEIVING
        if self.kv.admit(req, Budget(len(req.prompt)), self.agree) is not Admission.ADMITTED:
            req.status = RequestStatus.WAITING
            return False
        self.requests[req.rid] = req
        return True

    @property
    def alone_in_memory(self) -> bool:
        """No request holds memory (a reservation refused now will never fit)."""
        return not self.running and len(self.requests) == len(self.waiting)  # every other request is held

    def received(self, rid: Hashable, first: int) -> Request:
        """Its KV and state arrived and its first token is ``first``: it runs (or ends at once)."""
        req = self.requests[rid]
        assert req.status is RequestStatus.RECEIVING
        self.kv.computed([req])
        req.status = RequestStatus.RUNNING
        req.computed = len(req.prompt)
        req.tokens.append(first)
        if self._ended_by(req, first):
            self.kv.free(req, cache=True)
            self._finished(req)
        else:
            self.running.append(req)
        return req

    def abandon(self, rid: Hashable) -> None:
        """A held request will not run (its transfer failed, or it was given up): it stays held (``ABANDONED``)
        until ``drop`` once no writer can touch its memory."""
        self.requests[rid].status = RequestStatus.ABANDONED

    def drop(self, rid: Hashable) -> Request:
        """A held request that will not run, whose writers stopped: release its memory. It ends silently (whoever
        gave it up reported why)."""
        req = self.requests.pop(rid)
        assert req.status in HELD
        self.kv.free(req, cache=False)
        req.status = RequestStatus.FINISHED
        return req

    # --- one step --------------------------------------------------------------------------

    def _span(self, req: Request, budget: int) -> int:
        start = req.computed
        span = min(self.chunk_size, len(req.tokens) - start, budget)
        for p in req.wanted:  # end the chunk where a checkpoint is wanted
            if start < p < start + span:
                return p - start
        return span

    def _spans(self, reqs: list[Request]) -> tuple[list[int], int]:
        """Each request's span this step, in order, and what they leave of ``max_step_tokens``: a request with one
        token left to compute (a decode) takes it on top of the budget, the others within it."""
        spans, left = [], self.max_step_tokens
        for req in reqs:
            if len(req.tokens) - req.computed == 1:
                spans.append(1)
                continue
            span = self._span(req, left)
            spans.append(span)
            left -= span
        return spans, left

    def _admit(self, budget: int) -> list[int]:
        """Admit waiting requests into ``budget`` tokens of the step; the spans of those admitted."""
        kv, running = self.kv, self.running
        ends = [r.computed + self._span(r, self.max_step_tokens) for r in running]  # where this step may end each
        taken = kv.pages_needed(running, ends)  # the running requests' step: their fresh pages
        spans: list[int] = []
        page = kv.page_size
        prefilling = [(r, end) for r, end in zip(running, ends, strict=True) if _prefilling(r, page)]
        prefilling = prefilling if kv.prefix_cache else []
        at = 0  # the next waiting request to try; those before it wait for a running prefill
        while at < len(self.waiting) and len(self.running) < self.max_running and budget > 0:
            req = self.waiting[at]
            if at < WAITING_SCAN and self._waits_for_prefill(req, prefilling):
                at += 1
                self.prefix_waits += 1
                continue
            got = kv.admit(req, Budget(budget, taken, self.alone_in_memory), self.agree)
            if got is Admission.REFUSED:
                break
            del self.waiting[at]
            if got is Admission.TOO_BIG:
                kv.free(req, cache=False)  # a planned restore's pins
                self._fail_alone(req, "its first chunk and state slot do not fit")
                continue
            assert req.kv is not None
            req.computed = req.kv.seq_len
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            span = self._span(req, budget)
            taken += kv.pages_needed([req], [req.computed + span])
            budget -= span
            spans.append(span)
            if kv.prefix_cache and _prefilling(req, page):
                prefilling.append((req, req.computed + span))
        return spans

    def _waits_for_prefill(self, req: Request, prefilling: list[tuple[Request, int]]) -> bool:
        """One of ``prefilling`` (running requests with a page or more of their prompt not cached yet, each with
        where this step may end it) shares a prefix with ``req``, and ``req`` could start further than the cache
        lets it now once that prefix is computed (at a page boundary, or at a state checkpoint the running request
        stores when the model has recurrent layers: those are page-aligned too): admitted now, it would compute
        those tokens again. When the model has recurrent layers, the running request is given a checkpoint where
        ``req`` branches off when it stores none that deep (if the placement stores branch points and this step
        does not pass that position), and ``req`` waits for it."""
        page, limit = self.kv.page_size, len(req.tokens) - 1  # the last token is always computed
        for other, step_end in prefilling:
            cached = _cached_end(other, page)
            if other.cache_salt != req.cache_salt or cached + page > limit:
                continue
            shared = shared_prefix(req.tokens, other.prompt, limit)
            if self.kv.model_has_state:  # its checkpoints, sorted: the deepest within the shared prefix
                wanted = other.wanted
                at = bisect_right(wanted, shared)
                reach = wanted[at - 1] if at else 0
                branch = self.kv.kvm.placement.branch_off(shared)
                if branch is not None and branch > max(reach, step_end):
                    other.wanted = tuple(sorted({*wanted, branch}))
                    reach = branch
            else:
                reach = shared - shared % page
            if reach > cached:
                return True
        return False

    def next_step(self) -> Step | None:
        """Pick this step's requests and spans and allocate their memory (retracting when short)."""
        spans, budget = self._spans(self.running)  # and what the running requests leave of this step
        if self.waiting and len(self.running) < self.max_running and budget > 0:
            spans += self._admit(budget)
        while self.running:
            reqs = [r for r, s in zip(self.running, spans, strict=True) if s > 0]
            spans = [s for s in spans if s > 0]
            try:
                rows = self.kv.allocate(reqs, spans, self.agree)
            except OutOfMemory as exc:
                self._retract_newest(str(exc))
                spans, _ = self._spans(self.running)
                continue
            ending = [i for i, (r, n) in enumerate(zip(reqs, spans, strict=True)) if r.computed + n == len(r.tokens)]
            return Step(reqs, spans, self._batch(reqs, spans, rows), ending)
        return None

    def _batch(self, reqs: list[Request], spans: list[int], rows: StepRows) -> ForwardBatch:
        prefix = [r.computed for r in reqs]
        return ForwardBatch.from_pages(
            [r.tokens[p : p + s] for r, p, s in zip(reqs, prefix, spans, strict=True)],
            prefix,
            rows.pages,
            self.kv.page_size,
            rows.slots,
            rows.fresh,
            rows.checkpoints,
            [i for i, r in enumerate(reqs) if r.params.prompt_logprobs is not None and r.computed < len(r.prompt) - 1],
        )

    def _retract_newest(self, short: str) -> None:
        """Give the newest running request's memory back and queue it first again (nano-vllm's ``preempt``)."""
        req = self.running.pop()
        held = req.kv is not None and req.computed > req.kv.match.length  # computed something since its admission
        self.kv.free(req, cache=False)
        req.status, req.computed = RequestStatus.WAITING, 0
        self.waiting.appendleft(req)
        if self.alone_in_memory:
            self.waiting.popleft()
            self._fail_alone(req, short)
            return
        if held:  # a request admitted this step and refused at once held nothing: not a retraction
            req.retractions += 1
            self.retractions += 1

    def _fail_alone(self, req: Request, why: str) -> None:
        """End ``req`` (which holds nothing) as too big for the memory even alone."""
        self._end(
            req,
            FinishReason.ERROR,
            f"request {req.rid} ({len(req.tokens)} tokens) does not fit the memory budget even alone "
            f"({why}); raise gpu_memory or shorten the request",
        )

    def _ended_by(self, req: Request, token: int) -> bool:
        if token in req.stops:
            req.finish_reason = FinishReason.EOS if token not in req.params.stop_token_ids else FinishReason.STOP
        elif len(req.tokens) - len(req.prompt) >= req.params.max_new_tokens:  # the output's length, not a copy
            req.finish_reason = FinishReason.LENGTH
        return req.done

    def complete(self, step: Step, tokens: list[int | None]) -> None:
        """Record a finished forward and the tokens chosen from it (``computed`` then ``chosen``)."""
        self.computed(step)
        self.chosen(step, tokens)

    def computed(self, step: Step) -> list[Request]:
        """Record that ``step``'s spans are in memory. A prefill engine hands off every request whose
        prompt is now computed (returned, ``HANDED_OFF``): its KV/state can be sent before its token is known."""
        prefill = self.role is Role.PREFILL
        self.kv.computed(step.reqs, release_windows=not prefill)
        for req, span in zip(step.reqs, step.spans, strict=True):
            req.computed += span
        if not prefill:
            return []
        handed = [step.reqs[i] for i in step.ending]
        for req in handed:
            req.status = RequestStatus.HANDED_OFF  # its KV/state go to the sender; released by release_sent
        return handed

    def chosen(self, step: Step, tokens: list[int | None]) -> None:
        """Record the token chosen for each request of ``step`` (None: mid-prefill; ``NON_FINITE``:
        its logits were broken, it fails). A handed-off request only records its first token (or,
        broken, its error: the caller stops its sender, then ``release_sent``)."""
        ended: list[Request] = []
        for req, token in zip(step.reqs, tokens, strict=True):
            if token is None:
                continue
            broken = token == NON_FINITE
            if req.status is RequestStatus.HANDED_OFF:
                if broken:
                    req.finish_reason, req.error = FinishReason.ERROR, _non_finite(req)
                else:
                    req.tokens.append(token)
            elif broken:
                self.kv.free(req, cache=False)
                self._end(req, FinishReason.ERROR, _non_finite(req))
            else:
                req.tokens.append(token)
                if self._ended_by(req, token):
                    ended.append(req)
                    self._finished(req)
        if ended:  # cached, then released at once
            self.kv.free(*ended, cache=True)
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
