"""PDServer: the router of a disaggregated server (a prefill engine and a decode engine, each its own world).

``with PDServer(PDConfig(model_dir, prefill_pp=2, prefill_tp=1, decode_tp=2, transport="shm")) as s:
h = s.submit(ids, SamplingParams(...)); s.result(h)`` (or ``s.generate(prompts, params)``) returns per request
an ``Outcome``: tokens, finish reason, error, the prefix-cache hit (by tier) and its ``PDPath``
(``finished`` / ``failed``, the bytes moved, ``RequestTiming``). ``probe()`` asks every live worker what it
holds now (``WorkerState``).
The constructor checks the layout and every rank's checkpoint headers (``check_layout``: nothing starts
on a mismatch), starts the transfer bootstrap (a fresh cluster key) and, when the prefill ranks keep the
Mooncake Store below them and no master is named, one ``mooncake_master`` on 127.0.0.1 for all of them;
it launches the prefill engine (PP x TP processes, ``prefill_worker``) and the decode engine (TP
processes, ``decode_worker``) and waits for every worker's ``Ready`` (a failed start stops what it
started, unlinks every session file). The router thread owns every pipe and watches every process.

A request: ``Prefill`` to the prefill engine (its world rank 0 broadcasts commands to its peers; the
engine batches the chunks of several requests per step) -> ``Started`` (the hit) -> ``Reserve`` to the
decode engine (memory reserved, its transfer timer starts) -> ``First`` (the first token, chosen with the
request's ``SamplingParams``) -> ``Decode`` -> the decode engine runs it once every decode rank got every
prefill rank's KV/state (``Admitted``), streams each step's tokens (``Tokens``; ``submit(...,
on_token=f)`` calls ``f`` with each, in order, from the router thread) -> ``Done`` from every decode rank
(they must agree) when EOS, a stop id or ``max_new_tokens`` ends it.

Faults: a process that dies takes its engine down (its other processes killed and reaped, a decode
engine's shm files unlinked) and the engine restarts as a new epoch; the open requests it held are
computed again, one at a time and alone, so a poison request never takes the others with it; past
``restarts`` counted deaths the engine is lost and every open and new request fails with the reason
(the rule: ``quarantine``). A transfer failure (a decode-side timeout included) fails that request
alone; a prompt that does not fit beside those in flight waits, one that fits on no rank alone fails.
Workers' stderr goes through ``WorkerLog`` (Mooncake's log lines: counted records).
Invariants: every request ends exactly once; ``close`` stops every worker (each drains, verifies its
memory, reports its live pages and slots), reaps every process (terminate, then kill), closes every
pipe, the bootstrap and its master: no process of the server outlives ``close``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from hybridkv.engine.disagg.config import PDConfig, WorkerArgs, check_layout, with_store_master
from hybridkv.engine.disagg.engines import EngineState, PDStartError, await_ready, engine_name, launch, unlink_all
from hybridkv.engine.disagg.faults import FaultPlan
from hybridkv.engine.disagg.probes import ProbeCall, Probes
from hybridkv.engine.disagg.protocol import (
    Abort,
    Admitted,
    ClearCache,
    Crash,
    Decode,
    Done,
    Event,
    Failed,
    First,
    Live,
    Prefill,
    Ready,
    Report,
    Reserve,
    Sending,
    Sent,
    Started,
    Stop,
    TierFigures,
    Tokens,
)
from hybridkv.engine.disagg.quarantine import Quarantine
from hybridkv.engine.disagg.results import (
    ABORTED,
    FAILED,
    FINISHED,
    PDRank,
    Phase,
    RouterRequest,
    WorkerState,
    request_metrics,
)
from hybridkv.engine.disagg.tier_figures import tier_metrics
from hybridkv.engine.disagg.worker_log import WorkerLog
from hybridkv.engine.registry import text_config
from hybridkv.engine.sched.request import CheckedPrompt, Outcome, RequestError, SamplingParams, check_request
from hybridkv.engine.sched.scheduler import Role
from hybridkv.engine.weights import read_config
from hybridkv.tiers import MooncakeMaster
from hybridkv.transfer import BootstrapServer
from hybridkv.transfer.auth import ClusterKey
from hybridkv.transfer.shared import shm_path
from hybridkv.transfer.transport import transport_class

__all__ = ["FAILED", "FINISHED", "PDServer", "PDStartError"]
_Item = RouterRequest | ProbeCall | ClearCache | tuple[int, str] | None  # what the router's inbox carries


class PDServer:
    def __init__(self, config: PDConfig) -> None:
        check_layout(config)
        self.config = config
        self.master: MooncakeMaster | None = None  # started here for the prefill ranks' store (with_store_master)
        self.vocab_size = int(text_config(read_config(config.model_dir)).vocab_size)
        self.key = ClusterKey.generate()
        self.boot = BootstrapServer(key=self.key).start()
        self.ranks: list[PDRank] = []
        self.deaths: list[str] = []  # one line per worker that died while serving
        self.lost: dict[Role, str] = {}  # role -> why the engine was given up
        self.router_error = ""  # the router thread's traceback, if it failed
        self._requests: list[RouterRequest] = []
        self._tids: dict[str, RouterRequest] = {}
        self._inbox: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._probes = Probes()
        self._lock = threading.Lock()  # submit vs the router's final failure loops (one handle each, none missed)
        self._wake_r, self._wake_w = os.pipe()
        self._restarts = {Role.PREFILL: 0, Role.DECODE: 0}
        self._retired: list[EngineState] = []
        self._faults = FaultPlan(config.faults, config.prefill_tp)
        self._quarantine = Quarantine()
        self._in_flight: set[int] = set()  # dispatched and not ended
        self._session_files: list[str] = []  # every decode rank's shm arena, named before its process starts
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.prefill: EngineState | None = None
        self.decode: EngineState | None = None
        self.logs = WorkerLog()
        try:
            self.config, self.master = with_store_master(config)  # one master for every prefill rank's store
            self.prefill = self._launch(Role.PREFILL, 0)
            self.decode = self._launch(Role.DECODE, 0)
            await_ready([self.prefill, self.decode], config.timeout_s * 2)
        except BaseException:
            self._shutdown(0.0)  # a failed start: nothing to drain
            raise
        self._thread = threading.Thread(target=self._route, name="pd-router", daemon=True)
        self._thread.start()

    def submit(
        self,
        ids: CheckedPrompt | Sequence[int],
        params: SamplingParams | int | None = None,
        *,
        on_token: Callable[[int], None] | None = None,
        on_done: Callable[[Outcome], None] | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """Queue one request (``ids``: a ``CheckedPrompt``, checked for this server and not again, with its own
        params; or token ids and ``params``: its ``SamplingParams``, or just ``max_new_tokens``; seed None:
        its submission index); returns its handle. ``RequestError`` (nothing queued) names what to
        change. On the router thread, ``on_token(token)`` gets each output token once, in order, and
        ``on_done(result)`` the request's end, once. ``cache_salt``: its prefix-cache namespace (requests
        of other cache salts never share cached KV)."""
        if isinstance(ids, CheckedPrompt):
            if params is not None:
                raise TypeError("a CheckedPrompt carries the params it was checked with: give no params")
            checked = ids.served_by(self.vocab_size, self.config.max_context)
        else:
            if isinstance(params, int) or params is None:
                params = SamplingParams(max_new_tokens=self.config.max_new if params is None else params)
            checked = check_request(ids, params, self.vocab_size, self.config.max_context)
        params = checked.params
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) is not None:
                raise RequestError(
                    name, "not served by the disaggregated server yet; serve this request in one process"
                )
        with self._lock:
            if self._stopping:
                raise RuntimeError("the server is closed")
            if self.router_error or self._thread is None or not self._thread.is_alive():
                last = self.router_error.strip().splitlines()[-1] if self.router_error else "it exited"
                raise RuntimeError(f"the router thread is dead ({last}); see router_error, close this server")
            index = len(self._requests)
            req = RouterRequest(
                index, tuple(checked.ids), params.with_seed(index), time.monotonic(), on_token, on_done, cache_salt
            )
            self._requests.append(req)
            self._inbox.put(req)  # under the lock: ordered against the router's final failure loops
        self._wake()
        return index

    def abort(self, handle: int, reason: str = "by the client") -> None:
        """End an open request: it fails (finish reason ``abort``, its reason "aborted: ``reason``") and
        both engines release what it holds."""
        self._post((handle, f"{ABORTED}: {reason}"))

    def result(self, handle: int, timeout_s: float | None = None) -> Outcome:
        """The request's outcome, once it ended (default wait: 4 x ``timeout_s`` of the config)."""
        req = self._requests[handle]
        wait_s = self.config.timeout_s * 4 if timeout_s is None else timeout_s
        if not req.done.wait(wait_s):
            raise TimeoutError(f"request {handle} not finished after {wait_s} s")
        assert req.result is not None
        return req.result

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | int | None = None) -> list[Outcome]:
        handles = [self.submit(p, params) for p in prompts]
        return [self.result(h) for h in handles]

    def probe(self, timeout_s: float = 10.0) -> list[WorkerState]:
        """What every live worker holds now (prefill ranks, then decode ranks); ``TimeoutError`` if one
        does not answer (e.g. an engine is restarting)."""
        call = ProbeCall()
        self._post(call)
        if not call.done.wait(timeout_s):
            raise TimeoutError(f"{call.expected - len(call.states)} workers did not answer a probe in {timeout_s} s")
        return call.states

    def metrics(self) -> dict[str, Any]:
        """Router-side figures (host only, no round trip): requests per phase, outcomes, bytes, deaths;
        with tiers, the prefill ranks' tier counters as they last sent them (``tier_metrics``)."""
        return {
            **tier_metrics(self._engines(), self.config.engine.tiered),
            **request_metrics(list(self._requests)),
            "deaths": len(self.deaths),
            "restarts": {role.value: n for role, n in self._restarts.items()},
            "quarantined": len(self._quarantine.quarantined),
            "mooncake_log_lines": self.logs.total,
        }

    def clear_cache(self, host: bool = False) -> None:
        """Empty the prefill ranks' prefix caches (what requests hold stays), written back to their
        tiers; ``host``: host memory too, into the store. Applied before any request submitted later."""
        self._post(ClearCache(host))

    def shm_paths(self) -> list[str]:
        """The shared-memory files of every decode rank this server started (unlinked by ``close``)."""
        return list(self._session_files)

    def pids(self) -> list[int]:
        """Every worker process this server started (also dead and restarted ones)."""
        return [pid for e in self._engines() for pid in e.procs.pids]

    def _engines(self) -> list[EngineState]:
        """Every engine epoch started, once each (a lost engine is both current and retired)."""
        current = [e for e in (self.prefill, self.decode) if e is not None]
        return current + [e for e in self._retired if all(e is not c for c in current)]

    def _post(self, item: _Item) -> None:
        """Hand ``item`` to the router thread and wake it."""
        self._inbox.put(item)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._post(None)
        stuck = 0.0
        if self._thread is not None:
            self._thread.join(self.config.timeout_s * 2)
            if self._thread.is_alive():
                stuck = self.config.timeout_s * 2
        self._shutdown()  # even under a stuck router: no process of the server outlives close
        if stuck:
            raise RuntimeError(
                f"the router thread did not stop within {stuck:.0f} s (2 x timeout_s); its workers were reaped "
                "and its pipes closed under it, so its open requests may not end"
            )

    def __enter__(self) -> PDServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- engines ---------------------------------------------------------------------

    def _launch(self, role: Role, epoch: int) -> EngineState:
        c = self.config
        shared = role is Role.DECODE and transport_class(c.transport).shared_arena
        tokens = tuple(secrets.token_hex(16) for _ in range(c.decode_tp)) if shared else ()
        self._session_files += [shm_path(token) for token in tokens]
        args = WorkerArgs(c, engine_name(role, epoch), self.boot.address, self.key.hex, tokens)
        return launch(role, epoch, args, self.logs)

    def _shutdown(self, grace_s: float = 5.0) -> None:
        router_failed = bool(self.router_error) and self._thread is not None and not self._thread.is_alive()
        for e in self._engines():
            e.stop(grace_s, tell=router_failed)
        unlink_all(self._session_files)
        if self.master is not None:  # after the workers: their store clients are gone
            self.master.stop()
        self.boot.close()
        self.logs.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # --- router thread ---------------------------------------------------------------

    def _route(self) -> None:
        try:
            self._route_loop()
        except BaseException:  # a router bug must not leave callers waiting: fail what is open, say why
            with self._lock:  # submit refuses from here on: no request is appended after this loop
                self.router_error = traceback.format_exc()
                for req in self._requests:
                    self._fail(req, f"the router failed: {self.router_error.strip().splitlines()[-1]}")
            raise

    def _route_loop(self) -> None:
        stop_sent, deadline = False, 0.0
        while True:
            engines = [e for e in (self.prefill, self.decode) if e is not None and not e.dead]
            conns: dict[Connection, tuple[EngineState, int]] = {
                c: (e, r) for e in engines for r, c in enumerate(e.procs.conns)
            }
            sentinels = {p.sentinel: (e, r) for e in engines for r, p in enumerate(e.procs.procs)}
            if self._stopping:
                if not stop_sent:
                    stop_sent = True
                    deadline = time.monotonic() + self.config.timeout_s
                    for e in engines:
                        e.leader(Stop())
                if all(len(e.reports) == e.size for e in engines) or time.monotonic() > deadline:
                    break
            for obj in wait([self._wake_r, *conns, *sentinels], timeout=0.1):
                if obj == self._wake_r:
                    os.read(self._wake_r, 4096)
                    self._take_inbox()
                elif obj in conns:
                    e, r = conns[obj]
                    if e.dead:
                        continue
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        continue  # its sentinel reports the death
                    self._on_event(e, r, msg)
                elif obj in sentinels:
                    e, r = sentinels[obj]
                    self._drain(e, r)  # what it said before it exited (a Report, a Crash)
                    if not e.dead and not (self._stopping and r in e.reports):
                        self._on_death(e, r)
            self._pump()
        self._collect_reports()
        with self._lock:  # _stopping is set: submit refuses, so this loop sees every request
            for req in self._requests:
                self._fail(req, "the server closed before it finished")

    def _drain(self, e: EngineState, r: int) -> None:
        conn = e.procs.conns[r]
        with contextlib.suppress(EOFError, OSError):
            while conn.poll(0):
                self._on_event(e, r, conn.recv())

    def _take_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, ClearCache):
                if self.prefill is not None and not self.prefill.dead:
                    self.prefill.leader(item)
            elif isinstance(item, ProbeCall):
                self._probes.start(item, [e for e in (self.prefill, self.decode) if e is not None and not e.dead])
            elif isinstance(item, tuple):
                handle, reason = item
                if 0 <= handle < len(self._requests):
                    req = self._requests[handle]
                    if req.result is None:
                        self._fail(req, reason)
                        self._abort_everywhere(req, reason)
            elif item is not None:
                self._quarantine.queue.append(item.index)

    def _pump(self) -> None:
        """Dispatch what may go now (``Quarantine.next``: a suspect goes alone, the others wait for it)."""
        while not self._stopping and (index := self._quarantine.next(bool(self._in_flight))) is not None:
            if self._requests[index].result is None:
                self._dispatch(self._requests[index])

    def _dispatch(self, req: RouterRequest) -> None:
        if self.lost:
            self._fail(req, "; ".join(f"the {role.value} engine is lost: {why}" for role, why in self.lost.items()))
            return
        assert self.prefill is not None
        p = self.prefill
        req.restart(f"request-{req.index}.p{p.epoch}.a{req.attempts}", p.epoch)
        self._tids[req.tid] = req
        self._in_flight.add(req.index)
        fault = self._faults.on_dispatch(req.index, req.attempts)
        p.leader(Prefill(req.tid, req.ids, req.params, fault, req.cache_salt))

    def _on_event(self, e: EngineState, r: int, msg: Event) -> None:
        if isinstance(msg, Live):
            self._probes.answer(e, r, msg)
        elif isinstance(msg, Tokens):
            for tid, token in msg.chosen:
                req = self._tids.get(tid)
                if req is not None and req.result is None and req.tid == tid:
                    req.token(token)
        elif not e.record(r, msg):  # Ready, Report, Crash, TierFigures: the engine's own record
            assert not isinstance(msg, Ready | Report | Crash | TierFigures)
            req = self._tids.get(msg.tid)
            if req is not None and req.result is None and req.tid == msg.tid:  # not ended, not an earlier epoch's
                self._on_request_event(e, r, req, msg)

    def _on_request_event(self, e: EngineState, r: int, req: RouterRequest, msg: Event) -> None:
        if isinstance(msg, Started):
            req.started, req.cached, req.phase = msg.at, msg.cached_tokens, Phase.PREFILLING
            req.cached_details = msg.cached_details
            assert self.decode is not None
            req.decode_epoch = self.decode.epoch
            self.decode.leader(Reserve(msg.tid, req.ids, req.params, e.name))
        elif isinstance(msg, First):
            req.first_at, req.phase = msg.at, Phase.TRANSFERRING
            req.token(msg.token)
            assert self.decode is not None
            self.decode.leader(Decode(msg.tid, msg.token))
            victim = self._faults.on_first(req.index, req.attempts)
            if victim is not None:
                self.decode.procs.kill(victim)
        elif isinstance(msg, Sending):
            if self._faults.on_sending(req.index, req.attempts, r):
                e.procs.kill(r)
        elif isinstance(msg, Sent):
            req.sent[r] = msg
            self._maybe_complete(req)
        elif isinstance(msg, Admitted):
            req.admitted, req.phase = msg.at, Phase.DECODING
        elif isinstance(msg, Done):
            req.finals[r] = msg
            self._maybe_complete(req)
        elif isinstance(msg, Failed):
            self._fail(req, msg.reason, msg.transfer)
            self._abort_everywhere(req, msg.reason)

    def _abort_everywhere(self, req: RouterRequest, reason: str) -> None:
        """Both engines release what the request holds there (an unknown id is a no-op)."""
        for e in (self.prefill, self.decode):
            if e is not None and not e.dead and req.tid:
                e.leader(Abort(req.tid, reason))

    def _maybe_complete(self, req: RouterRequest) -> None:
        """Complete once every decode rank is done and every prefill rank reported its sender's end
        (or the prefill epoch that computed it died after the decode side got everything)."""
        prefill = self.prefill
        assert prefill is not None
        reported = len(req.sent) == prefill.size or req.prefill_epoch != prefill.epoch
        if len(req.finals) == self.config.decode_tp and reported:
            self._complete(req)

    def _complete(self, req: RouterRequest) -> None:
        error = req.complete(self.config.prefill_tp)
        self._in_flight.discard(req.index)
        if error:
            self._fail(req, error)

    def _fail(self, req: RouterRequest, reason: str, transfer: bool = False) -> None:
        self._in_flight.discard(req.index)
        req.fail(reason, transfer)

    def _on_death(self, e: EngineState, r: int) -> None:
        crash = e.crash.get(r, "").strip().splitlines()
        why = f"{e.names[r]} (pid {e.procs.pids[r]}, epoch {e.epoch}) died: {e.procs.exit_reason(r)}"
        if crash:
            why += f" ({crash[-1]})"
        self.deaths.append(why)
        started = len(e.ready) == e.size
        e.retire()
        self._retired.append(e)
        survivor = self.decode if e.role is Role.PREFILL else self.prefill
        assert survivor is not None
        present = [r for r in self._requests if r.result is None and r.tid and r.held_by(e.role, e.epoch, e.size)]
        for req in present:
            self._in_flight.discard(req.index)
            if req.started:  # the other engine may hold its reservation or its legs: end them
                survivor.leader(Abort(req.tid, why))
                req.attempts += 1
            req.reasons.append(why)
        failed = self._quarantine.record(e.role, why, [req.index for req in present], started)
        for req in present:
            if req.index in failed:
                self._fail(req, failed[req.index])
            elif not started:
                self._quarantine.requeue(req.index)  # not implicated: dispatched again as it was
        if self._stopping:
            return
        if self._quarantine.counted(e.role) > self.config.restarts:
            self.lost[e.role] = why
            self._quarantine.clear()
            for req in self._requests:
                self._fail(req, f"the {e.role.value} engine is lost: {why}")
            return
        self._restarts[e.role] += 1
        fresh = self._launch(e.role, e.epoch + 1)
        if e.role is Role.PREFILL:
            self.prefill = fresh
        else:
            self.decode = fresh
        for req in self._requests:  # landed requests that waited only for the dead engine's Sent
            if req.result is None and req.finals:
                self._maybe_complete(req)

    def _collect_reports(self) -> None:
        for e in [self.prefill, self.decode]:
            if e is not None and not e.dead:
                self.ranks += e.ranks(self.config.prefill_tp)
