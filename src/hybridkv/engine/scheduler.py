"""Scheduler: continuous batching of chunked prefills and decodes, over the prefix cache, with retraction.

Every step runs all running requests together: each feeds its next uncomputed tokens (up to
``chunk_size`` while prefilling, one while decoding) within ``max_step_tokens``; a chunk that
would pass a position where the checkpoint placement wants the state stored
(``RequestMemory.wanted``: page-aligned, from ``KVManager.wanted_checkpoints``) ends there
instead, so chunk sizes need not be aligned to pages. Waiting requests are admitted while
their cache hit's state slot and the pages of their first chunk fit
(``RequestAllocator.admit``, which matches the prompt: computation starts at the hit's end;
the first request of an empty batch always starts). Memory for a step comes from one
``RequestAllocator.extend`` call; when it raises ``OutOfMemory`` (the cache had nothing left
to evict) the most recently admitted request is retracted: it releases its handle (what it
inserted stays cached), returns to the front of the queue (counted as a retraction when it
held memory) and, when admitted again, matches again and recomputes only what the cache does
not hold (its output stays exact). A request that cannot fit even alone fails with an error
naming the budget; the others go on.

Invariants:
- A request's ``computed`` tokens are exactly the ones whose K/V and state are in memory
  (its handle's ``seq_len``); logits are taken only when a step's span reaches the end of
  its known tokens.
- Finished, failed and retracted requests hold no handle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from hybridkv.engine.allocator import RequestAllocator, RequestMemory
from hybridkv.engine.batch import ForwardBatch
from hybridkv.memory import OutOfMemory


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    eos: frozenset[int] = frozenset()
    namespace: Hashable = None
    mem: RequestMemory = field(default_factory=RequestMemory)
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    finish_reason: str | None = None
    error: str | None = None
    retractions: int = 0

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Step:
    reqs: list[Request]
    spans: list[int]
    batch: ForwardBatch


class Scheduler:
    def __init__(self, alloc: RequestAllocator, chunk_size: int, max_running: int, max_step_tokens: int):
        if chunk_size < 1 or max_running < 1 or max_step_tokens < 1:
            raise ValueError("chunk_size, max_running and max_step_tokens must be >= 1")
        self.alloc = alloc
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.failed: list[Request] = []
        self.retractions = 0

    def add(self, req: Request) -> None:
        req.mem = self.alloc.new(req.namespace)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _span(self, req: Request, budget: int) -> int:
        start = req.computed
        span = min(self.chunk_size, len(req.tokens) - start, budget)
        for p in req.mem.wanted:  # end the chunk where a checkpoint is wanted
            if start < p < start + span:
                return p - start
        return span

    def _step_pages(self, req: Request, budget: int) -> int:
        """Fresh pages ``req`` needs for its next span."""
        return req.mem.live.pages_needed(req.computed + self._span(req, budget))

    def _admit(self, budget: int) -> None:
        taken = sum(self._step_pages(r, self.max_step_tokens) for r in self.running)  # the running requests' step
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            req = self.waiting[0]
            force = not self.running
            try:
                if not self.alloc.admit(req.mem, req.tokens, len(req.prompt), budget, taken, force):
                    return
            except OutOfMemory as exc:
                self.waiting.popleft()
                self._fail(req, exc)
                continue
            req.computed = req.mem.length
            self.running.append(self.waiting.popleft())
            taken += self._step_pages(req, budget)
            budget -= self._span(req, budget)

    def next_step(self) -> Step | None:
        """Pick this step's requests and spans and allocate their memory (retracting on OutOfMemory)."""
        budget = self.max_step_tokens
        for req in self.running:  # what the running requests take of this step: admit into the rest
            budget -= self._span(req, budget)
        self._admit(budget)
        while self.running:
            reqs, spans, left = [], [], self.max_step_tokens
            for req in self.running:
                span = self._span(req, left)
                if span > 0:
                    reqs.append(req)
                    spans.append(span)
                    left -= span
            try:
                self.alloc.extend([r.mem for r in reqs], spans)
            except OutOfMemory as exc:
                self._retract_newest(exc)
                continue
            prefix = [r.computed for r in reqs]
            handles = [r.mem.live for r in reqs]
            has_state = self.alloc.has_state
            batch = ForwardBatch.build(
                [r.tokens[p : p + s] for r, p, s in zip(reqs, prefix, spans, strict=True)],
                prefix,
                [h.token_locs() for h in handles],
                [h.state_slot or 0 for h in handles] if has_state else None,
                [r.mem.fresh for r in reqs] if has_state else None,
            )
            return Step(reqs, spans, batch)
        return None

    def _retract_newest(self, exc: OutOfMemory) -> None:
        req = self.running.pop()
        h = req.mem.handle
        held = h is not None and h.seq_len > h.match.length  # computed something since its admission
        self.alloc.retract(req.mem)
        req.computed = 0
        if not self.running:
            self._fail(req, exc)
            return
        if held:  # a request admitted this step and refused at once held nothing: not a retraction
            req.retractions += 1
            self.retractions += 1
        self.waiting.appendleft(req)

    def _fail(self, req: Request, exc: OutOfMemory) -> None:
        self.alloc.retract(req.mem)
        req.error = (
            f"request {req.index} ({len(req.tokens)} tokens) does not fit the memory budget even alone "
            f"({exc}); raise gpu_memory or shorten the request"
        )
        req.finish_reason = "error"
        self.failed.append(req)

    def complete(self, step: Step, sample: list[int | None]) -> list[Request]:
        """Record a finished forward: ``sample[i]`` is the token chosen for request ``i`` (None: mid-prefill)."""
        self.alloc.mark_computed([r.mem for r in step.reqs])
        finished = []
        for req, span, token in zip(step.reqs, step.spans, sample, strict=True):
            if req.computed < len(req.tokens) - 1:  # a prefill chunk (not a decode)
                self.alloc.chunk_done(req.mem, req.tokens)
            req.computed += span
            if token is None:
                continue
            req.tokens.append(token)
            if token in req.eos:
                req.finish_reason = "eos"
            elif len(req.output) >= req.max_new_tokens:
                req.finish_reason = "length"
            if req.done:
                self.alloc.finish(req.mem, req.tokens)
                finished.append(req)
        self.running = [r for r in self.running if not r.done]
        return finished
