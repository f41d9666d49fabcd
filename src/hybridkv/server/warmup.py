"""Warm-up before a server says it listens: the first requests then cost what later ones cost.

A fresh process pays once for what no later request pays again: each new GEMM shape's kernels
(oneDNN builds bf16/AMX kernels per shape), the allocator's first pages, and in PD the
connections, mappings and first transfers between workers. ``warm_up`` pays it before the HTTP
server starts: it sends a short fixed schedule of greedy requests through the ``Backend`` (the
very path every client request takes), all at once, so prefill steps of many lengths (1 token
up to two chunks) and decode steps of many batch sizes run; and enough prompts of the longest length a request
may have that the first step is a full one (the step budget's tokens: the engine's largest activations, which a
burst of clients makes at once, allocated and faulted in here). Measured (widened tiny-gemma3-dense fp32, 2-core
Zen 5): without the full step, the first burst after start of 64 requests on a cached prefix took one 1024-token
step of 262 ms where later bursts took 182 ms. Last, ``Backend.reserve`` grows the engine's step buffers to their
budgeted size and faults them in: a burst's gathered keys (64 rows x a 144-token context) outgrew what the full step
had made, and the first such step took 217 ms where later ones took 178 (179 with the buffers reserved).

Invariants:
- Warm-up requests use a cache salt of their own (random per process): no client request can
  ever hit what they cached, and they are the oldest entries, evicted first.
- Every warm-up request ends (or the warm-up gives up after ``timeout_s`` and aborts the
  rest): nothing it started stays open when ``warm_up`` returns.
- A warm-up request that fails means the backend cannot serve: ``WarmupFailed`` with the
  backend's reason; the server does not start.
- They are ordinary requests: the engine's counters (``hybridkv_engine_requests_total``,
  prompt tokens, steps) include them; ``WarmupReport`` says how many and how long.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.engine.logprobs import TokenLogprob
from hybridkv.engine.sched.request import FinishReason, Outcome, SamplingParams
from hybridkv.server.backend import Backend

POLL_S = 0.05  # how often a wait looks at ``stop``
ABORT_WAIT_S = 30.0  # an aborted request's end, at most
NEW_TOKENS = 4  # decode steps per warm-up request
SCHEDULE = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144)
"""Prompt lengths (beside one and two prefill chunks): prefill shapes small to large, and as the requests
end one by one, decode batches of every size up to their number."""


class WarmupFailed(RuntimeError):
    """A warm-up request failed: the backend cannot serve."""


@dataclass(frozen=True)
class WarmupReport:
    requests: int
    prompt_tokens: int
    seconds: float
    timed_out: bool  # the warm-up ended early (its timeout, or a shutdown signal): the rest was aborted
    reserved_bytes: int  # the step buffers ``Backend.reserve`` allocated and faulted in (0 when it ended early)


class Ended:
    """A ``Sink`` that only remembers how the request ended."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Outcome | None = None

    def on_token(self, token: int, logprob: TokenLogprob | None = None) -> None:
        del token, logprob

    def on_finish(self, result: Outcome) -> None:
        self.result = result
        self.done.set()


def prompt_lengths(chunk_size: int, max_context: int, step_tokens: int = 0) -> list[int]:
    """The schedule's prompt lengths that fit one request (prompt + ``NEW_TOKENS`` <= ``max_context``), then as many
    prompts of the longest such length as bring the total to ``step_tokens`` (the step budget) or more."""
    room = max_context - NEW_TOKENS
    wanted = {*SCHEDULE, chunk_size, chunk_size + 1, 2 * chunk_size + 1}
    lengths = sorted(n for n in wanted if 1 <= n <= room)
    short = step_tokens - sum(lengths)
    if short > 0 and room >= 1:
        lengths += [room] * -(-short // room)
    return lengths


def warm_up(
    backend: Backend, timeout_s: float = 120.0, stop: Callable[[], bool] = lambda: False, seed: int = 0
) -> WarmupReport:
    """Run the warm-up schedule through ``backend`` (all requests at once) and wait for every one to end;
    past ``timeout_s``, or once ``stop()`` (a shutdown signal), abort the rest."""
    start = time.perf_counter()
    described = backend.describe()
    chunk = int(described.get("chunked_prefill_size") or 64)
    step_tokens = int(described.get("max_prefill_tokens") or 0)
    rng = random.Random(seed)
    vocab = backend.info.vocab_size
    cache_salt = f"hybridkv-warmup-{secrets.token_hex(8)}"
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    open_: list[tuple[int, Ended]] = []
    lengths = prompt_lengths(chunk, backend.info.max_context, step_tokens)
    for n in lengths:
        sink = Ended()
        open_.append((backend.submit([rng.randrange(vocab) for _ in range(n)], params, sink, cache_salt), sink))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for ticket, sink in open_:
        while not sink.done.is_set():
            if stop() or time.monotonic() > deadline:
                timed_out = True
                backend.abort(ticket, "the warm-up ended early")
                sink.done.wait(ABORT_WAIT_S)
                break
            sink.done.wait(POLL_S)
    for _, sink in open_:
        result = sink.result
        if result is not None and result.finish_reason == FinishReason.ERROR:
            raise WarmupFailed(f"a warm-up request failed: {result.error}")
    reserved = 0 if timed_out or stop() else backend.reserve()
    return WarmupReport(len(lengths), sum(lengths), time.perf_counter() - start, timed_out, reserved)
