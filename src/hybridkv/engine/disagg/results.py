"""What a disaggregated server reports per request and per worker, and the router's record of a request.

A request's end is an ``Outcome`` (tokens, finish reason, error, prefix-cache hit) whose ``pd`` is its
``PDPath``: ``finished`` / ``failed``, the bytes moved, the attempts and ``RequestTiming``. ``RouterRequest`` is
the router's mutable record of one request while it is open; its ``phase`` only moves forward
within an attempt (QUEUED -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED, or FAILED from
anywhere); a retry after an engine death starts the next attempt at QUEUED.

Invariants: a request's tokens reach its ``on_token`` callback once each, in order, whatever the
number of attempts (a retry computes the same tokens: greedy, or seeded per position; the ones
already streamed are not streamed again); its ``on_done`` is called exactly once, with its result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hybridkv.engine.disagg.path import PDPath, RequestTiming, StageTiming
from hybridkv.engine.disagg.protocol import Done, Sent
from hybridkv.engine.sched.request import FinishReason, Outcome, SamplingParams
from hybridkv.engine.sched.scheduler import Role

FINISHED = "finished"
FAILED = "failed"
ABORTED = "aborted"
"""How the reason of a request ended by ``PDServer.abort`` starts (its finish reason is ``abort``)."""


class Phase(Enum):
    QUEUED = "queued"  # submitted, or re-routed after an engine death
    PREFILLING = "prefilling"  # the prefill engine scheduled it (its decode memory is being reserved)
    TRANSFERRING = "transferring"  # its first token is known; its KV/state is on the way
    DECODING = "decoding"  # every decode rank holds its KV/state
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class PDRank:
    """What one worker reported when it stopped (a worker that died reports nothing)."""

    role: str  # "prefill" or "decode"
    index: int  # PP stage (prefill) or TP rank (decode)
    tp: int  # TP rank inside the stage (prefill; decode: ``index``)
    epoch: int  # 0, then one more per restart of its engine
    pid: int
    live_before: tuple[int, int]  # (pages, slots) live before the first request
    live_after: tuple[int, int]  # and after draining: equal when nothing leaked
    transfer_bytes: int
    requests: int


@dataclass(frozen=True)
class WorkerState:
    """One live worker's answer to ``PDServer.probe``: ``live == live_before`` and ``requests == 0``
    when it is idle and holds nothing (the prefill prefix cache's pages and checkpoints excluded)."""

    name: str  # e.g. "prefill stage 1 TP rank 0"
    epoch: int
    pid: int
    live_before: tuple[int, int]  # (pages, slots) live before its first request
    live: tuple[int, int]  # (pages, slots) live now, less what the prefill prefix cache holds
    requests: int  # requests holding memory there now
    threads: int  # the intra-op threads it runs


@dataclass
class RouterRequest:
    index: int
    ids: tuple[int, ...]
    params: SamplingParams
    submitted: float
    on_token: Callable[[int], None] | None = None
    on_done: Callable[[Outcome], None] | None = None
    cache_salt: str | None = None  # its prefix-cache namespace on the prefill engine
    done: threading.Event = field(default_factory=threading.Event)
    phase: Phase = Phase.QUEUED
    tid: str = ""
    prefill_epoch: int = -1
    decode_epoch: int = -1  # the decode engine it was reserved on (-1: not yet)
    started: float = 0.0
    cached: int = 0
    cached_details: dict[str, int] | None = None  # ``cached`` by tier (prefill world rank 0's)
    first_at: float = 0.0
    sent: dict[int, Sent] = field(default_factory=dict)  # prefill rank -> how its sender ended
    admitted: float = 0.0
    finals: dict[int, Done] = field(default_factory=dict)  # decode rank -> its tokens
    seen: int = 0  # output tokens of this attempt so far
    streamed: int = 0  # output tokens handed to ``on_token`` so far, over every attempt
    attempts: int = 1  # + 1 per retry after an engine died holding it
    reasons: list[str] = field(default_factory=list)  # why it was re-routed or retried
    result: Outcome | None = None

    def restart(self, tid: str, prefill_epoch: int) -> None:
        """A new attempt (first, re-routed or retried) on the prefill engine ``prefill_epoch``."""
        self.tid, self.prefill_epoch, self.decode_epoch = tid, prefill_epoch, -1
        self.phase = Phase.QUEUED
        self.started = self.first_at = self.admitted = 0.0
        self.seen = 0
        self.sent.clear()
        self.finals.clear()

    def held_by(self, role: Role, epoch: int, size: int) -> bool:
        """Whether the engine ``role`` of ``epoch`` (``size`` ranks) holds this attempt: prefill, dispatched to
        it and its KV/state not landed on the decode side; decode, reserved on it."""
        if role is Role.DECODE:
            return self.decode_epoch == epoch
        landed = self.admitted or (len(self.sent) == size and all(sent.ok for sent in self.sent.values()))
        return self.prefill_epoch == epoch and not landed

    def token(self, token: int) -> None:
        """The attempt's next output token: streamed unless an earlier attempt streamed it."""
        self.seen += 1
        if self.seen > self.streamed:
            self.streamed = self.seen
            if self.on_token is not None:
                self.on_token(token)

    def timing(self, last: float) -> RequestTiming:
        """Its seconds, the slowest decode rank's last token at ``last``."""
        decode_s = max(0.0, last - self.admitted)
        n = len(next(iter(self.finals.values())).tokens) if self.finals else 1
        return RequestTiming(
            queue_s=max(0.0, self.started - self.submitted),
            prefill_s=max(0.0, self.first_at - self.started),
            transfer_s=max(0.0, self.admitted - self.first_at),
            decode_s=decode_s,
            ttft_s=max(0.0, self.first_at - self.submitted),
            tpot_s=decode_s / (n - 1) if n > 1 else 0.0,
        )

    def complete(self, prefill_tp: int) -> str:
        """Finish with the decode ranks' tokens (the empty string), or why it cannot (they disagree)."""
        outputs = {(done.tokens, done.finish_reason) for done in self.finals.values()}
        if len(outputs) != 1:
            return f"decode ranks disagree on the tokens: {sorted(outputs)}"
        (tokens, finish_reason) = outputs.pop()
        for token in tokens[self.seen :]:  # what the streamed ``Tokens`` did not carry
            self.token(token)
        stages = tuple(
            StageTiming(k // prefill_tp, k % prefill_tp, s.computed, s.sending, s.nbytes, s.ops, s.ok, s.reason)
            for k, s in sorted(self.sent.items())
        )
        decode_bytes = tuple(self.finals[k].nbytes for k in sorted(self.finals))
        self.phase = Phase.FINISHED
        path = PDPath(
            FINISHED,
            self.timing(max(done.at for done in self.finals.values())),
            sum(decode_bytes),
            self.attempts,
            tuple(self.reasons),
            stages,
            decode_bytes,
        )
        self.result = Outcome(
            list(tokens),
            finish_reason,
            None,
            len(self.ids),
            self.cached,
            cached_tokens_details=self.cached_details,
            retractions=next(iter(self.finals.values())).retractions,
            rid=self.index,
            pd=path,
        )
        self._ended()
        return ""

    def _ended(self) -> None:
        self.done.set()
        if self.on_done is not None and self.result is not None:
            self.on_done(self.result)

    def fail(self, reason: str, transfer: bool = False) -> None:
        """End it failed with ``reason`` (``transfer``: the transfer layer's); a request ends once: later
        calls change nothing."""
        if self.result is None:
            self.phase = Phase.FAILED
            aborted = reason.startswith(ABORTED)
            self.result = Outcome(
                [],
                FinishReason.ABORT if aborted else FinishReason.ERROR,
                reason,
                len(self.ids),
                self.cached,
                cached_tokens_details=self.cached_details,
                rid=self.index,
                pd=PDPath(FAILED, None, 0, self.attempts, tuple(self.reasons), transfer_failed=transfer),
            )
            self._ended()


def pd_path(outcome: Outcome) -> PDPath:
    """The path of a request the PD server ended (every outcome it reports has one)."""
    if outcome.pd is None:
        raise ValueError(f"request {outcome.rid}: not ended by a PD server (no PDPath)")
    return outcome.pd


def request_metrics(requests: list[RouterRequest]) -> dict[str, Any]:
    """Requests per phase and the ended ones' outcomes (host figures)."""
    phases = {p.value: 0 for p in Phase}
    for r in requests:
        phases[r.phase.value] += 1
    done = [r.result for r in requests if r.result is not None]
    paths = [r.pd for r in done if r.pd is not None]
    return {
        "requests": len(requests),
        "phases": phases,
        "finished": sum(p.status == FINISHED for p in paths),
        "failed": sum(p.status == FAILED for p in paths),
        "transfer_bytes": sum(p.transfer_bytes for p in paths),
        "transfer_failures": sum(p.transfer_failed for p in paths),
        "cached_tokens": sum(r.cached_tokens for r in done),
        **{
            f"cached_tokens_{where}": sum((r.cached_tokens_details or {}).get(where, 0) for r in done)
            for where in ("device", "host", "storage")
        },
        "retractions": sum(r.retractions for r in done),
    }
