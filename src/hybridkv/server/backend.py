"""The one interface the HTTP front end serves through: ``Backend`` (single-process engine or PD server).

A backend takes validated token requests from any thread and reports each one's tokens and its
end through the request's ``Sink``, from its own thread. The front end never touches an engine.

Invariants every backend keeps:
- ``submit`` either refuses at once (``RequestError`` naming the field, ``QueueFull``,
  ``BackendClosed``: nothing queued, no callback ever) or returns a ticket; from then on the
  sink gets ``on_token`` for every chosen token, in order (with its log-probability when the
  request asked: ``SamplingParams.logprobs``), then ``on_finish`` exactly once (finished, aborted
  or failed), all from the backend's thread.
- ``abort(ticket)`` of an open request ends it with ``FinishReason.ABORT`` and releases its
  memory; of a ticket already ended it does nothing.
- ``flush_cache(host)`` empties the prefix cache only while no request is open (else it answers why
  not and changes nothing): every page and slot the cache kept goes back to the free pools (with
  tiers below, written back to them as on any eviction; ``host``: host memory too, into the store).
- ``close`` stops taking requests, ends every open one (``abort``) and stops every thread and
  process of the backend within its timeout.
- ``metrics`` is a snapshot of plain numbers; the front end exports the keys it knows
  (``hybridkv.server.metrics``): ``running``, ``waiting``, ``pools`` ({pool: {live, free,
  cached}} cells), ``live_pages``, ``live_slots``, ``cached_pages``, ``cached_states``,
  ``held_pages`` / ``held_slots`` (held by requests: live minus what the prefix cache keeps),
  ``evicted_pages``, ``evicted_states`` and the counters ``steps``, ``requests``, ``aborted``,
  ``errors``, ``retractions``, ``prompt_tokens``, ``cached_tokens``, ``hit_full_tokens``,
  ``hit_window_tokens``, ``hit_checkpoint_tokens``, ``engine_thread_cpu_s`` (CPU seconds of the
thread that runs the engine), and for PD ``transfer_bytes``, ``transfer_failures``, ``deaths``,
  ``quarantined``, ``mooncake_log_lines``, ``probe_ok``, ``phases`` ({phase: open requests}),
  ``restarts`` ({engine: n}) and ``workers`` (per worker: ``worker``, ``epoch``, ``pid``,
  ``live_pages``, ``live_slots``, ``before_pages``, ``before_slots``, ``requests``); with tiers
  below the device, ``tiers`` (``TieredCache.metrics``). A key a backend lacks is not exported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from hybridkv.engine.logprobs import TokenLogprob
from hybridkv.engine.sched.request import Outcome, SamplingParams


class QueueFull(RuntimeError):
    """The backend holds as many open requests as it may; try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendClosed(RuntimeError):
    """The backend is shutting down or broken; it takes no more requests."""


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the served model's name (``/v1/models``)
    vocab_size: int
    max_context: int
    """Prompt + new tokens of one request, at most: the memory budget is sized so that one request
    of this length fits alone (a longer one is refused at submit)."""
    memory_budget: str  # the budget per device, as given (``--gpu-memory``)
    eos_ids: frozenset[int]


class Sink(Protocol):
    """Where a backend reports one request; called from the backend's thread, never concurrently."""

    def on_token(self, token: int, logprob: TokenLogprob | None = None) -> None: ...

    def on_finish(self, result: Outcome) -> None: ...


class Backend(Protocol):
    info: ModelInfo

    def submit(self, prompt: list[int], params: SamplingParams, sink: Sink, cache_salt: str | None = None) -> int:
        """Queue one request (thread-safe); its ticket. ``cache_salt``: its prefix-cache namespace."""
        ...

    def abort(self, ticket: int, reason: str) -> None:
        """End an open request now (thread-safe; its sink gets ``on_finish`` with ``abort``)."""
        ...

    def health(self) -> str | None:
        """None while the backend serves; else why it does not (shutting down, broken)."""
        ...

    def flush_cache(self, host: bool) -> str | None:
        """Empty the prefix cache (``host``: host memory too); None once done (for requests submitted from
        then on), else why it was refused (requests are open)."""
        ...

    def reserve(self) -> int:
        """Allocate what the engine's steps would grow into under load (its step buffers, at their budgeted size) and
        fault it in now: the warm-up's last act. The bytes; 0 where the engines live in other processes."""
        ...

    def describe(self) -> dict[str, Any]:
        """How the backend is sized and laid out, in SGLang's ``/get_server_info`` names where one exists
        (``page_size``, ``max_running_requests``, ``chunked_prefill_size``, ...)."""
        ...

    def metrics(self) -> dict[str, Any]:
        """A snapshot of the backend's figures (thread-safe; may block for one engine step)."""
        ...

    def close(self, timeout_s: float) -> None:
        """Stop: refuse new requests, abort the open ones, stop every thread and process."""
        ...
