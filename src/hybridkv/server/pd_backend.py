"""PDBackend: a disaggregated ``PDServer`` (a router thread, prefill and decode worker processes) as a ``Backend``.

The PD server's router thread is the backend's thread: it calls each request's ``on_token`` and
``on_done``, which go straight to the request's ``Sink``. A ticket is the PD server's handle.

Invariants:
- Open requests (submitted, not yet ended) never exceed ``max_running + max_queued``: one more is
  refused with ``QueueFull`` before the PD server sees it; a refusal (``check_request``'s ``RequestError``
  naming the field, a dead router: ``BackendClosed``) leaves nothing counted.
- A prompt is checked once, here (``check_request``); the PD server takes its ``CheckedPrompt`` as is.
- Every ticket ends exactly once through its sink: from the router's ``on_done`` (finished,
  failed, aborted), or from ``close`` for one the router could not end (it was stuck); one lock
  decides which, so a late ``on_done`` changes nothing.
- ``health`` is None while the router runs and neither engine is lost; else the router's error or
  the lost engine's reason (the PD server fails every request from then on, so new ones are
  refused at once with ``BackendClosed``).
- ``metrics``: the router's figures (requests per phase, outcomes, prefix-cache hit tokens,
  transfer bytes and failures, retractions, worker deaths, restarts per engine) and what every
  live worker holds now (``probe``: pages and slots outside the prefill prefix cache, against
  what it held before its first request; requests holding memory), summed into ``held_pages`` /
  ``held_slots``. A probe that gets no answer within ``probe_timeout_s`` (an engine restarting)
  leaves the worker figures out and says so (``probe_ok`` 0), never blocks a scrape for long.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from hybridkv.engine.disagg import PDServer
from hybridkv.engine.registry import eos_ids, text_config
from hybridkv.engine.sched.request import FinishReason, Outcome, RequestError, SamplingParams, check_request
from hybridkv.engine.weights import read_config
from hybridkv.server.backend import BackendClosed, ModelInfo, QueueFull, Sink

IN_FLIGHT = ("prefilling", "transferring", "decoding")  # PD phases of a running request ("queued": waiting)


@dataclass
class _Open:
    sink: Sink
    prompt_tokens: int
    ticket: int | None = None  # known once submit returned
    ended: bool = False


class PDBackend:
    def __init__(
        self, server: PDServer, name: str, memory_budget: str, max_queued: int = 256, probe_timeout_s: float = 5.0
    ):
        """``server``: a started ``PDServer`` (this backend closes it); ``memory_budget``: its budget per
        worker process, as given."""
        self.server = server
        config = server.config
        eos = eos_ids(text_config(read_config(config.model_dir)))
        self.info = ModelInfo(name, server.vocab_size, config.max_context, memory_budget, eos)
        self.capacity = config.engine.max_running + max_queued
        self.probe_timeout_s = probe_timeout_s
        self._cond = threading.Condition()
        self._open: dict[int, _Open] = {}  # ticket -> request, once submit returned (under _cond)
        self._open_count = 0  # tickets handed out (or being handed out) and not ended (under _cond)
        self._closing = False
        self._counts = {"aborted": 0, "errors": 0, "prompt_tokens": 0}

    # --- any thread -------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, sink: Sink, cache_salt: str | None = None) -> int:
        with self._cond:
            why = self.health()
            if why is not None:
                raise BackendClosed(why)
            if self._open_count >= self.capacity:
                raise QueueFull(f"{self._open_count} requests are open, the most this server queues; retry later")
            self._open_count += 1
        try:
            checked = check_request(prompt, params, self.info.vocab_size, self.info.max_context)
            req = _Open(sink, len(checked.ids))
            ticket = self.server.submit(
                checked, on_token=sink.on_token, on_done=lambda result: self._end(req, result), cache_salt=cache_salt
            )
        except RequestError:
            self._release()
            raise
        except RuntimeError as exc:  # the PD server is closed or its router is dead
            self._release()
            raise BackendClosed(str(exc)) from None
        with self._cond:
            self._counts["prompt_tokens"] += len(checked.ids)
            req.ticket = ticket
            if not req.ended:
                self._open[ticket] = req
        return ticket

    def abort(self, ticket: int, reason: str) -> None:
        self.server.abort(ticket, reason)

    def health(self) -> str | None:
        server = self.server
        if server.router_error:
            last = server.router_error.strip().splitlines()[-1]
            return f"the PD router failed ({last}); restart the server"
        if server.lost:
            lost = "; ".join(f"the {role.value} engine is lost: {why}" for role, why in server.lost.items())
            return f"{lost}; restart the server"
        return "the server is shutting down" if self._closing else None

    def flush_cache(self, host: bool) -> str | None:
        """Posted to the router, which applies it on every prefill rank before any request submitted later (the
        decode engine keeps no prefix cache)."""
        with self._cond:
            if self._open_count:
                return f"{self._open_count} requests are open; flush once they ended (or abort them)"
            self.server.clear_cache(host)
        return None

    def reserve(self) -> int:
        return 0  # the engines are the worker processes': each grows its step buffers as its steps need

    def describe(self) -> dict[str, Any]:
        config = self.server.config
        engine = config.engine
        return {
            "page_size": engine.page_size,
            "chunked_prefill_size": engine.chunk_size,
            "max_prefill_tokens": engine.step_tokens,
            "max_running_requests": engine.max_running,
            "disable_radix_cache": not engine.prefix_cache,
            "tiers": engine.tiered,
            "disaggregation_mode": "internal",
            "prefill_pp": config.prefill_pp,
            "prefill_tp": config.prefill_tp,
            "decode_tp": config.decode_tp,
            "transfer_backend": config.transport,
        }

    def metrics(self) -> dict[str, Any]:
        pd = self.server.metrics()
        phases: dict[str, int] = pd["phases"]
        with self._cond:
            counts = dict(self._counts)
        m: dict[str, Any] = {
            "running": sum(phases[p] for p in IN_FLIGHT),
            "waiting": phases["queued"],
            "phases": {p: phases[p] for p in ("queued", *IN_FLIGHT)},
            "requests": pd["requests"],
            **counts,
            "cached_tokens": pd["cached_tokens"],
            "retractions": pd["retractions"],
            "transfer_bytes": pd["transfer_bytes"],
            "transfer_failures": pd["transfer_failures"],
            "deaths": pd["deaths"],
            "restarts": pd["restarts"],
            "quarantined": pd["quarantined"],
            "mooncake_log_lines": pd["mooncake_log_lines"],
        }
        if "tier_written_bytes" in pd:  # the prefill ranks' tiers, summed (``tier_metrics``)
            m["tiers"] = pd_tiers(pd)
        try:
            states = self.server.probe(self.probe_timeout_s)
        except TimeoutError:
            m["probe_ok"] = 0
            return m
        m["probe_ok"] = 1
        m["workers"] = [
            {
                "worker": w.name,
                "epoch": w.epoch,
                "pid": w.pid,
                "live_pages": w.live[0],
                "live_slots": w.live[1],
                "before_pages": w.live_before[0],
                "before_slots": w.live_before[1],
                "requests": w.requests,
                "threads": w.threads,
            }
            for w in states
        ]
        m["held_pages"] = sum(w.live[0] - w.live_before[0] for w in states)
        m["held_slots"] = sum(w.live[1] - w.live_before[1] for w in states)
        return m

    def close(self, timeout_s: float) -> None:
        """Abort every open request, wait (up to ``timeout_s``) for the router to end them, then close the PD
        server (every worker stopped and reaped, every shm file unlinked); a request the router did not end
        ends here, aborted."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            tickets = list(self._open)
        for ticket in tickets:
            self.server.abort(ticket, "the server shut down")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._open_count and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
        try:
            self.server.close()
        except RuntimeError as exc:  # its router was stuck: its workers are reaped anyway
            print(f"hybridkv: {exc}", file=sys.stderr)
        with self._cond:
            left = list(self._open.values())
        for req in left:
            self._end(req, Outcome([], FinishReason.ABORT, "the server shut down", req.prompt_tokens, 0))

    # --- the router thread ------------------------------------------------------------------

    def _end(self, req: _Open, finished: Outcome) -> None:
        with self._cond:
            if req.ended:
                return
            req.ended = True
            if req.ticket is not None:
                del self._open[req.ticket]
            if finished.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                self._counts["aborted" if finished.finish_reason is FinishReason.ABORT else "errors"] += 1
        req.sink.on_finish(finished)
        self._release()

    def _release(self) -> None:
        with self._cond:
            self._open_count -= 1
            self._cond.notify_all()


def pd_tiers(pd: dict[str, Any]) -> dict[str, Any]:
    """The prefill ranks' summed tier counters in the shape the exporter reads from a single
    engine's tiers (``TieredCache.metrics``); the store is up while no live rank finds it down."""
    tiers: dict[str, Any] = {
        key: pd[f"tier_{key}"]
        for key in ("written_bytes", "write_refused", "write_around", "loaded_bytes", "misses", "fallbacks")
    }
    if any("store" in rank for rank in pd["prefill_tiers"].values()):
        tiers["store"] = {"up": pd["tier_store_ranks_down"] == 0}
    return tiers
