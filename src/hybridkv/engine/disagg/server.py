"""PDServer: the router of a disaggregated server (a prefill engine and a decode engine, each its own world).

``with PDServer(PDConfig(model_dir, prefill_pp=2, prefill_tp=1, decode_tp=2, transport="shm")) as s:
h = s.submit(ids, max_new); s.result(h)`` (or ``s.generate(prompts, max_new)``) returns per request
``RequestResult``: tokens, ``finished`` / ``failed`` with a reason, the prefix-cache hit, the bytes
moved and ``RequestTiming`` (queue, prefill, transfer, decode, TTFT, TPOT). ``probe()`` asks every
live worker what it holds now (``WorkerState``: live pages and slots outside the prefill prefix
cache vs before its first request, requests holding memory), so a leak shows while serving.

The constructor checks the layout (``check_layout``: nothing starts on a mismatch), starts the
transfer bootstrap (a fresh cluster key), and launches two ``EngineProcs``: the prefill engine
(PP x TP processes, ``prefill_worker``) and the decode engine (TP processes, ``decode_worker``),
then waits for every worker's ``Ready``. The router thread owns every pipe and supervises
every process (pipes and process sentinels in one ``multiprocessing.connection.wait``).

A request: ``Prefill`` to every prefill rank -> ``Started`` (the prefix-cache hit) -> ``Reserve``
to the decode engine (its transfer timer starts) -> ``First`` (the first token, carried by the
router, not by a cross-engine collective) -> ``Decode`` -> the decode engine admits it when every
decode rank got every prefill rank's KV/state -> ``Done`` from every decode rank (they must agree).

Faults. An engine death is retried once, a transfer failure is not:
- a prefill process dies: its engine's remaining processes are killed and reaped and the
  engine restarts as a new epoch (new processes, new bootstrap name). Every request it held
  and had not fully sent is computed again from its prompt on the new epoch (``attempts`` 2);
  the decode side aborts the old reservation (its pages are freed once the dead writer is
  proven gone). Requests it had not started are simply re-routed (no attempt spent).
- a decode process dies: the same for the decode engine (its shared-memory files unlinked);
  every request reserved on it and not done is computed again (prefill again, on the
  prefill engine, whose prefix cache now holds it) and decoded on the new epoch; the prefill
  senders abort the old legs and release their pages.
- a request whose retry is hit by a death again ends ``failed`` with both reasons.
- a transfer timeout (decode side) or any other transfer failure ends that request ``failed``
  with the transfer layer's reason, and so does a prompt the prefill memory cannot hold beside
  the requests still being sent ("prefill memory is full"); nothing else is affected.
- after ``restarts`` restarts of an engine it is reported lost (``lost``): every request not
  finished, and every new one, fails with the reason.
Invariants: every request ends exactly once; ``close`` stops every worker (each drains, verifies
its memory and reports its live pages and slots), then reaps every process (terminate, then
kill), closes every pipe and the bootstrap: no process of the server outlives ``close``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from hybridkv.engine.disagg.config import PDConfig, WorkerArgs, check_layout
from hybridkv.engine.disagg.decode_worker import decode_main
from hybridkv.engine.disagg.prefill_worker import prefill_main
from hybridkv.engine.disagg.procs import EngineProcs, exit_reason
from hybridkv.engine.disagg.protocol import (
    Abort,
    Admitted,
    Crash,
    Decode,
    Done,
    Event,
    Failed,
    First,
    Live,
    Prefill,
    Probe,
    Ready,
    Report,
    Reserve,
    Sending,
    Sent,
    Started,
    Stop,
)
from hybridkv.transfer import BootstrapServer, TransferError
from hybridkv.transfer.auth import ClusterKey

FINISHED = "finished"
FAILED = "failed"


class PDStartError(TransferError):
    """An engine did not come up: the message holds its workers' tracebacks or exit codes."""


@dataclass(frozen=True)
class RequestTiming:
    """One request's seconds; ``queue + prefill`` is the TTFT, ``transfer`` and ``decode`` follow it."""

    queue_s: float  # submitted -> prefill starts it
    prefill_s: float  # -> the first token
    transfer_s: float  # -> every decode rank holds every prefill rank's KV/state
    decode_s: float  # -> the slowest decode rank has the last token
    ttft_s: float  # submitted -> first token
    tpot_s: float  # decode seconds per token after the first (0 when only one token)


@dataclass(frozen=True)
class StageTiming:
    """One prefill rank's part of a request (``time.monotonic`` stamps, one clock per host)."""

    pp: int
    tp: int
    compute: tuple[float, float]  # its prefill of the request: started, last chunk done
    send: tuple[float, float]  # handed to its sender -> the sender finished (every decode rank's leg)
    nbytes: int  # bytes it wrote, to every decode rank
    ops: int  # write ops it submitted for them (contiguous runs; a TP-sliced page gives one per token)
    ok: bool
    reason: str = ""  # why its sender failed ("" when ok)


@dataclass(frozen=True)
class RequestResult:
    index: int  # submission order
    output_ids: list[int]  # max_new greedy tokens ([] when failed)
    status: str  # FINISHED or FAILED
    reason: str  # why it failed ("" when finished)
    timing: RequestTiming | None  # None when failed
    cached_tokens: int  # the prefill-side prefix-cache hit
    transfer_bytes: int  # KV/state bytes every decode rank received, summed
    attempts: int  # 1, or 2 when an engine died holding it and it was computed again
    notes: tuple[str, ...]  # the deaths that re-routed or retried it
    stages: tuple[StageTiming, ...] = ()  # per prefill rank (stage, TP rank) of its last attempt
    decode_bytes: tuple[int, ...] = ()  # bytes each decode TP rank received (finished requests)


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


@dataclass
class _ProbeCall:
    done: threading.Event = field(default_factory=threading.Event)
    states: list[WorkerState] = field(default_factory=list)
    expected: int = 0
    seq: int = 0  # echoed in every ``Live``: a late answer to an earlier probe is dropped


@dataclass
class _Request:
    index: int
    ids: tuple[int, ...]
    max_new: int
    submitted: float
    done: threading.Event = field(default_factory=threading.Event)
    tid: str = ""
    prefill_epoch: int = -1
    decode_epoch: int = -1  # the decode engine it was reserved on (-1: not yet)
    started: float = 0.0
    cached: int = 0
    first_at: float = 0.0
    sent: dict[int, Sent] = field(default_factory=dict)  # prefill rank -> how its sender ended
    admitted: float = 0.0
    nbytes: int = 0
    tokens: dict[int, Done] = field(default_factory=dict)  # decode rank -> its tokens
    attempts: int = 1  # 2 once retried after an engine died holding it
    reasons: list[str] = field(default_factory=list)  # why it was re-routed or retried
    result: RequestResult | None = None


class _Engine:
    def __init__(self, role: str, epoch: int, procs: EngineProcs, names: list[str]) -> None:
        self.role, self.epoch, self.procs, self.names = role, epoch, procs, names
        self.ready: set[int] = set()
        self.before: dict[int, tuple[int, int]] = {}
        self.shm: dict[int, str] = {}
        self.crash: dict[int, str] = {}
        self.dead = False
        self.reports: dict[int, Report] = {}

    @property
    def name(self) -> str:
        return f"pd-{self.role}-{self.epoch}"


class PDServer:
    def __init__(self, config: PDConfig) -> None:
        check_layout(config)
        self.config = config
        self.key = ClusterKey.generate()
        self.boot = BootstrapServer(key=self.key).start()
        self.ranks: list[PDRank] = []
        self.deaths: list[str] = []  # one line per worker that died while serving
        self.lost: dict[str, str] = {}  # role -> why the engine was given up
        self.router_error = ""  # the router thread's traceback, if it failed
        self._requests: list[_Request] = []
        self._tids: dict[str, _Request] = {}
        self._inbox: queue.SimpleQueue[_Request | _ProbeCall | None] = queue.SimpleQueue()
        self._probe: _ProbeCall | None = None
        self._probes = 0  # probe sequence numbers handed out
        self._lock = threading.Lock()  # submit vs the router's final failure loops (one handle each, none missed)
        self._wake_r, self._wake_w = os.pipe()
        self._restarts = {"prefill": 0, "decode": 0}
        self._retired: list[_Engine] = []
        self._faults = {f.request: f for f in config.faults}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.prefill: _Engine | None = None
        self.decode: _Engine | None = None
        try:
            self.prefill = self._launch("prefill", 0)
            self.decode = self._launch("decode", 0)
            self._await_ready([self.prefill, self.decode])
        except BaseException:
            self._shutdown()
            raise
        self._thread = threading.Thread(target=self._route, name="pd-router", daemon=True)
        self._thread.start()

    # --- public API ------------------------------------------------------------------

    def submit(self, ids: list[int] | tuple[int, ...], max_new: int) -> int:
        """Queue one request (greedy, ``max_new`` tokens); returns its handle (the submission index)."""
        if not ids or max_new < 1:
            raise ValueError(f"a request needs at least one token and max_new >= 1, got {len(ids)} and {max_new}")
        if len(ids) + max_new > self.config.max_context:
            raise ValueError(
                f"a prompt of {len(ids)} tokens + {max_new} new exceeds max_context {self.config.max_context}; "
                "shorten it, lower max_new or start the server with a larger max_context"
            )
        with self._lock:
            if self._stopping:
                raise RuntimeError("the server is closed")
            if self.router_error or self._thread is None or not self._thread.is_alive():
                last = self.router_error.strip().splitlines()[-1] if self.router_error else "it exited"
                raise RuntimeError(f"the router thread is dead ({last}); see router_error, close this server")
            req = _Request(len(self._requests), tuple(int(t) for t in ids), max_new, time.monotonic())
            self._requests.append(req)
            self._inbox.put(req)
        os.write(self._wake_w, b"x")
        return req.index

    def result(self, handle: int, timeout_s: float | None = None) -> RequestResult:
        """The request's outcome, once it ended (default wait: 4 x ``timeout_s`` of the config)."""
        req = self._requests[handle]
        wait_s = self.config.timeout_s * 4 if timeout_s is None else timeout_s
        if not req.done.wait(wait_s):
            raise TimeoutError(f"request {handle} not finished after {wait_s} s")
        assert req.result is not None
        return req.result

    def generate(self, prompts: list[list[int]] | tuple[tuple[int, ...], ...], max_new: int) -> list[RequestResult]:
        handles = [self.submit(p, max_new) for p in prompts]
        return [self.result(h) for h in handles]

    def probe(self, timeout_s: float = 10.0) -> list[WorkerState]:
        """What every live worker holds now (prefill ranks, then decode ranks); ``TimeoutError`` if one
        does not answer (e.g. an engine is restarting)."""
        call = _ProbeCall()
        self._inbox.put(call)
        os.write(self._wake_w, b"x")
        if not call.done.wait(timeout_s):
            raise TimeoutError(f"{call.expected - len(call.states)} workers did not answer a probe in {timeout_s} s")
        return call.states

    def shm_paths(self) -> list[str]:
        """The shared-memory files of every decode rank this server started (unlinked by ``close``)."""
        return [path for e in self._engines() for path in e.shm.values() if path]

    def pids(self) -> list[int]:
        """Every worker process this server started (also dead and restarted ones)."""
        return [pid for e in self._engines() for pid in e.procs.pids]

    def _engines(self) -> list[_Engine]:
        """Every engine epoch started, once each (a lost engine is both current and retired)."""
        current = [e for e in (self.prefill, self.decode) if e is not None]
        return current + [e for e in self._retired if all(e is not c for c in current)]

    def close(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._inbox.put(None)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
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

    def _launch(self, role: str, epoch: int) -> _Engine:
        c = self.config
        name = f"pd-{role}-{epoch}"
        args = WorkerArgs(c, name, self.boot.address, self.key.hex)
        if role == "prefill":
            procs = EngineProcs(name, prefill_main, c.prefill_pp * c.prefill_tp, (args,), c.timeout_s)
            names = [f"prefill stage {s} TP rank {t}" for s in range(c.prefill_pp) for t in range(c.prefill_tp)]
        else:
            procs = EngineProcs(name, decode_main, c.decode_tp, (args,), c.timeout_s)
            names = [f"decode TP rank {t}" for t in range(c.decode_tp)]
        return _Engine(role, epoch, procs, names)

    def _await_ready(self, engines: list[_Engine]) -> None:
        """Block until every worker said Ready; ``PDStartError`` (with tracebacks) if one crashed or died."""
        end = time.monotonic() + self.config.timeout_s * 2
        while any(len(e.ready) < len(e.procs.conns) for e in engines):
            objs = {c: (e, r) for e in engines for r, c in enumerate(e.procs.conns) if r not in e.ready}
            sentinels = {p.sentinel: (e, r) for e in engines for r, p in enumerate(e.procs.procs)}
            left = end - time.monotonic()
            got = wait(list(objs) + list(sentinels), timeout=max(0.0, left))
            if left <= 0:
                raise PDStartError(f"workers not ready within {self.config.timeout_s * 2:.0f} s")
            for obj in got:
                if obj in objs:
                    e, r = objs[obj]
                    try:
                        msg = obj.recv()
                    except EOFError:
                        continue
                    if isinstance(msg, Ready):
                        e.ready.add(r)
                        e.shm[r], e.before[r] = msg.shm_path, msg.live
                    elif isinstance(msg, Crash):
                        raise PDStartError(f"{e.names[r]} failed to start:\n{msg.traceback}")
                elif obj in sentinels:
                    e, r = sentinels[obj]
                    code = e.procs.procs[r].exitcode
                    raise PDStartError(f"{e.names[r]} died while starting ({exit_reason(code)})")

    def _shutdown(self) -> None:
        for e in self._engines():
            e.procs.close(5.0 if not e.dead else 0.0)
            _unlink(e.shm.values())
        self.boot.close()
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
        stop_sent = False
        while True:
            engines = [e for e in (self.prefill, self.decode) if e is not None and not e.dead]
            conns: dict[Connection, tuple[_Engine, int]] = {
                c: (e, r) for e in engines for r, c in enumerate(e.procs.conns)
            }
            sentinels = {p.sentinel: (e, r) for e in engines for r, p in enumerate(e.procs.procs)}
            if self._stopping:
                if not stop_sent:
                    stop_sent = True
                    deadline = time.monotonic() + self.config.timeout_s
                    for e in engines:
                        for r in range(len(e.procs.conns)) if e.role == "prefill" else [0]:
                            e.procs.send(r, Stop())
                if all(len(e.reports) == len(e.procs.conns) for e in engines) or time.monotonic() > deadline:
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
        self._collect_reports()
        with self._lock:  # _stopping is set: submit refuses, so this loop sees every request
            for req in self._requests:
                self._fail(req, "the server closed before it finished")

    def _drain(self, e: _Engine, r: int) -> None:
        conn = e.procs.conns[r]
        with contextlib.suppress(EOFError, OSError):
            while conn.poll(0):
                self._on_event(e, r, conn.recv())

    def _take_inbox(self) -> None:
        while True:
            try:
                req = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(req, _ProbeCall):
                self._start_probe(req)
            elif req is not None:
                self._dispatch(req)

    def _start_probe(self, call: _ProbeCall) -> None:
        engines = [e for e in (self.prefill, self.decode) if e is not None and not e.dead]
        call.expected = sum(len(e.procs.conns) for e in engines)
        self._probes += 1
        call.seq = self._probes
        self._probe = call  # an earlier, timed-out probe is dropped: its late answers carry its seq
        for e in engines:
            for r in range(len(e.procs.conns)) if e.role == "prefill" else [0]:
                e.procs.send(r, Probe(call.seq))

    def _dispatch(self, req: _Request) -> None:
        if self.lost:
            self._fail(req, "; ".join(f"the {role} engine is lost: {why}" for role, why in self.lost.items()))
            return
        assert self.prefill is not None
        p = self.prefill
        req.prefill_epoch, req.decode_epoch = p.epoch, -1
        req.tid = f"request-{req.index}.p{p.epoch}.a{req.attempts}"
        req.started, req.first_at, req.admitted, req.nbytes = 0.0, 0.0, 0.0, 0
        req.sent.clear()
        req.tokens.clear()
        self._tids[req.tid] = req
        fault = self._faults.get(req.index) if req.attempts == 1 else None
        tp = self.config.prefill_tp
        for r in range(len(p.procs.conns)):
            hits = fault is not None and (fault.kind == "stall-transfer" or r == fault.rank * tp)
            if fault is not None and hits and fault.kind != "kill-decode":
                p.procs.send(r, Prefill(req.tid, req.ids, fault.kind, fault.delay_s))
            else:
                p.procs.send(r, Prefill(req.tid, req.ids))

    def _on_event(self, e: _Engine, r: int, msg: Event) -> None:
        if isinstance(msg, Report):
            e.reports[r] = msg
            return
        if isinstance(msg, Ready):
            e.ready.add(r)
            e.shm[r], e.before[r] = msg.shm_path, msg.live
            return
        if isinstance(msg, Live):
            call = self._probe
            if call is not None and msg.seq == call.seq:
                before = e.before.get(r, (0, 0))
                call.states.append(WorkerState(e.names[r], e.epoch, e.procs.pids[r], before, msg.live, msg.requests))
                if len(call.states) == call.expected:
                    call.states.sort(key=lambda w: (not w.name.startswith("prefill"), w.name))
                    self._probe = None
                    call.done.set()
            return
        if isinstance(msg, Crash):
            e.crash[r] = msg.traceback
            return
        req = self._tids.get(msg.tid)
        if req is None or req.result is not None or req.tid != msg.tid:  # unknown, ended, or an earlier epoch's
            return
        if isinstance(msg, Started):
            req.started, req.cached = msg.at, msg.cached_tokens
            assert self.decode is not None
            req.decode_epoch = self.decode.epoch
            self.decode.procs.send(0, Reserve(msg.tid, len(req.ids), e.name))
        elif isinstance(msg, First):
            req.first_at = msg.at
            assert self.decode is not None
            self.decode.procs.send(0, Decode(msg.tid, msg.token, req.max_new))
            fault = self._faults.get(req.index)
            if fault is not None and fault.kind == "kill-decode" and req.attempts == 1:
                self.decode.procs.kill(fault.rank)
        elif isinstance(msg, Sending):
            fault = self._faults.get(req.index)
            target = fault.rank * self.config.prefill_tp if fault is not None else -1
            if fault is not None and fault.kind == "kill-prefill" and req.attempts == 1 and r == target:
                e.procs.kill(r)
        elif isinstance(msg, Sent):
            req.sent[r] = msg
            self._maybe_complete(req)
        elif isinstance(msg, Admitted):
            req.admitted, req.nbytes = msg.at, msg.nbytes
        elif isinstance(msg, Done):
            req.tokens[r] = msg
            self._maybe_complete(req)
        elif isinstance(msg, Failed):
            self._fail(req, msg.reason)
            assert self.prefill is not None
            if req.prefill_epoch == self.prefill.epoch:
                for k in range(len(self.prefill.procs.conns)):
                    self.prefill.procs.send(k, Abort(req.tid, msg.reason))

    def _maybe_complete(self, req: _Request) -> None:
        """Complete once every decode rank is done and every prefill rank reported its sender's end
        (or the prefill epoch that computed it died after the decode side got everything)."""
        prefill = self.prefill
        assert prefill is not None
        reported = len(req.sent) == len(prefill.procs.conns) or req.prefill_epoch != prefill.epoch
        if len(req.tokens) == self.config.decode_tp and reported:
            self._complete(req)

    def _complete(self, req: _Request) -> None:
        outputs = {done.tokens for done in req.tokens.values()}
        if len(outputs) != 1:
            self._fail(req, f"decode ranks disagree on the tokens: {sorted(outputs)}")
            return
        tokens = list(outputs.pop())
        last = max(done.at for done in req.tokens.values())
        decode_s = max(0.0, last - req.admitted)
        timing = RequestTiming(
            queue_s=max(0.0, req.started - req.submitted),
            prefill_s=max(0.0, req.first_at - req.started),
            transfer_s=max(0.0, req.admitted - req.first_at),
            decode_s=decode_s,
            ttft_s=max(0.0, req.first_at - req.submitted),
            tpot_s=decode_s / (req.max_new - 1) if req.max_new > 1 else 0.0,
        )
        tp = self.config.prefill_tp
        stages = tuple(
            StageTiming(k // tp, k % tp, sent.computed, sent.sending, sent.nbytes, sent.ops, sent.ok, sent.reason)
            for k, sent in sorted(req.sent.items())
        )
        decode_bytes = tuple(req.tokens[k].nbytes for k in sorted(req.tokens))
        req.result = RequestResult(
            req.index,
            tokens,
            FINISHED,
            "",
            timing,
            req.cached,
            req.nbytes,
            req.attempts,
            tuple(req.reasons),
            stages,
            decode_bytes,
        )
        req.done.set()

    def _fail(self, req: _Request, reason: str) -> None:
        if req.result is None:
            req.result = RequestResult(
                req.index, [], FAILED, reason, None, req.cached, 0, req.attempts, tuple(req.reasons)
            )
            req.done.set()

    def _on_death(self, e: _Engine, r: int) -> None:
        e.procs.procs[r].join(1.0)  # its sentinel fired: it exited, collect the code
        code = e.procs.procs[r].exitcode
        crash = e.crash.get(r, "").strip().splitlines()
        why = f"{e.names[r]} (pid {e.procs.pids[r]}, epoch {e.epoch}) died: {exit_reason(code)}"
        if crash:
            why += f" ({crash[-1]})"
        self.deaths.append(why)
        e.dead = True
        e.procs.close(0.0)  # its peers' collectives are broken: end them all now
        _unlink(e.shm.values())
        self._retired.append(e)
        survivor = self.decode if e.role == "prefill" else self.prefill
        assert survivor is not None
        retry = []
        for req in self._requests:
            if req.result is not None or not req.tid:
                continue
            if e.role == "prefill":
                landed = req.admitted or (
                    len(req.sent) == len(e.procs.conns) and all(sent.ok for sent in req.sent.values())
                )
                held = req.prefill_epoch == e.epoch and not landed
            else:
                held = req.decode_epoch == e.epoch
            if not held:
                continue
            if req.started:  # the other engine may hold its reservation or its legs: end them
                for k in range(len(survivor.procs.conns) if survivor.role == "prefill" else 1):
                    survivor.procs.send(k, Abort(req.tid, why))
                if req.attempts >= 2:
                    self._fail(req, f"{why} (on its retry)")
                    continue
                req.attempts += 1
            req.reasons.append(why)
            retry.append(req)
        if self._stopping:
            return
        if self._restarts[e.role] >= self.config.restarts:
            self.lost[e.role] = why
            for req in self._requests:
                self._fail(req, f"the {e.role} engine is lost: {why}")
            return
        self._restarts[e.role] += 1
        fresh = self._launch(e.role, e.epoch + 1)
        if e.role == "prefill":
            self.prefill = fresh
        else:
            self.decode = fresh
        for req in retry:
            self._dispatch(req)
        for req in self._requests:  # landed requests that waited only for the dead engine's Sent
            if req.result is None and req.tokens:
                self._maybe_complete(req)

    def _collect_reports(self) -> None:
        for e in [self.prefill, self.decode]:
            if e is None or e.dead:
                continue
            for r, rep in sorted(e.reports.items()):
                tp = self.config.prefill_tp if e.role == "prefill" else 1
                index, within = divmod(r, tp) if e.role == "prefill" else (r, r)
                self.ranks.append(
                    PDRank(
                        e.role,
                        index,
                        within,
                        e.epoch,
                        e.procs.pids[r],
                        rep.live_before,
                        rep.live_after,
                        rep.transfer_bytes,
                        rep.requests,
                    )
                )


def _unlink(paths: Any) -> None:
    for path in paths:
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
