"""One prefill rank (PP stage x TP rank) of a disaggregated server: a ``Scheduler`` in the prefill role + a sender.

Every rank runs the same scheduler (``Role.PREFILL``) over its own memory and prefix cache:
prompt chunks of several requests are batched per step within the token budget; hits,
admissions and allocations are agreed over the engine's world (``WorldAgreement``: stages hold
other pools). As soon as a stage has run its layers over a request's last chunk, the request
is handed off: the rank pins its *whole* KV/state through ``KVManager.pin`` (cached pages
included; the plan sends what the decode side needs) and gives it to its sender, so the
transfer overlaps the later stages' compute. Then the last stage's logits of the requests that
ended their prompt this step are broadcast (one broadcast per such step, none per chunk) and
every rank chooses their first tokens with their ``SamplingParams`` (as a single engine would).
With ``host_memory`` / ``store`` in the config each rank keeps its own tiers below its device
(``prefill_tiers``: its host memory, its client of the router's Mooncake master, keys of its
shard); a hit is restored from them at the length every rank can restore (``EngineTiers.agreed``).
``ClearCache`` empties every rank's prefix cache into its tiers. Every rank sends its tier
counters (``TierFigures``) when they changed: before each ``Sent``, after a ``ClearCache``, else
at most every ``FIGURES_S``. Decode ranks keep no tiers: their KV arrives from the prefill engine.
World rank 0 reports ``Started`` (with the agreed hit and where its own part came from, when a
request is first scheduled), ``First`` and the failures; every rank reports ``Sent`` (its compute
and send windows).

Invariants:
- A handed-off request's pages and slot stay held and pinned until its sender reported it
  finished (success or failure); then ``release_sent`` caches its prompt (pages and checkpoints:
  the KV is valid whatever the transfer did) and releases the rest. Windows are not trimmed on
  a prefill engine (the sender reads the prompt's whole window).
- A request that cannot fit even alone fails alone (``Failed``); one that waits for memory
  held by senders waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from hybridkv.engine.disagg.config import PDConfig, WorkerArgs
from hybridkv.engine.disagg.faults import on_compute, on_hand_off, slows_writes
from hybridkv.engine.disagg.protocol import (
    Abort,
    ClearCache,
    Command,
    Failed,
    First,
    Prefill,
    Sending,
    Sent,
    Started,
    TierFigures,
)
from hybridkv.engine.disagg.worker import Worker
from hybridkv.engine.parallel.groups import StageGroups
from hybridkv.engine.registry import eos_ids
from hybridkv.engine.runner import build_runner
from hybridkv.engine.sched.kv import RequestKV
from hybridkv.engine.sched.request import FinishReason, Request
from hybridkv.engine.sched.sampling import NON_FINITE
from hybridkv.engine.sched.scheduler import Role, Step, choose_step_tokens
from hybridkv.engine.sched.tiered import ZERO_DETAILS, EngineTiers
from hybridkv.spec import Parallel
from hybridkv.transfer import Phase, PrefillSender, Transport
from hybridkv.transfer.auth import ClusterKey
from hybridkv.transfer.transport import transport_class
from hybridkv.transfer.transport.drills import Throttled

FIGURES_S = 1.0  # a rank's tier counters reach the router at most this often between requests


@dataclass
class _Stamps:
    """When this rank computed a request and handed it to its sender (``time.monotonic``)."""

    started: float = 0.0  # first scheduled
    computed: float = 0.0  # its last chunk ran on this stage
    handed: float = 0.0


class PrefillRank(Worker):
    role = Role.PREFILL

    def __init__(self, rank: int, conn: Connection, args: WorkerArgs) -> None:
        c = args.config
        super().__init__(rank, conn, args, c.prefill_pp * c.prefill_tp)
        layout = Parallel(pp_size=c.prefill_pp, tp_size=c.prefill_tp)
        groups = StageGroups.create(layout, range(self.size), c.timeout_s)
        assert groups is not None  # every rank of this world is in the layout
        self.groups = groups
        self.runner = build_runner(
            c.model_dir, c.model_dir, c.engine, groups.parallel, groups.pp_rank, groups.tp_rank, groups
        )
        self.eos = eos_ids(self.runner.model.config)
        self.mem = self.runner.mem
        e = c.engine
        self.kv = RequestKV(self.mem, prefix_cache=e.prefix_cache, cache_policy=e.cache_policy, checkpoints=e.placement)
        self.tiers = self.kv.tiers = prefill_tiers(self.kv, c)
        self.sched = self.scheduler()
        kind = transport_class(c.transport)
        inner = kind.create(None, **kind.loopback_options)
        self.throttle: Throttled | None = None
        self.transport: Transport = inner
        if slows_writes(c.faults):
            self.throttle = self.transport = Throttled(inner, 0.0)
        key = ClusterKey.from_hex(args.key_hex, "prefill worker")
        self.sender = PrefillSender(
            self.mem, args.engine, args.bootstrap, self.transport, key=key, timeout_s=c.timeout_s
        )
        self.stamps: dict[str, _Stamps] = {}
        self.faults: dict[str, Prefill] = {}
        self.delayed: dict[str, float] = {}  # tid -> when to hand it to the sender (stall-transfer)
        self.figures_sent: dict[str, object] | None = None
        self.figures_due = 0.0

    def close(self) -> None:
        try:
            self.sender.close()
            self.transport.close()
        finally:
            if self.tiers is not None:
                self.tiers.close()

    def held_live(self) -> tuple[int, int]:
        pages, slots = super().held_live()
        cache = self.kv.cache
        return pages - cache.cached_pages, slots - cache.num_checkpoints

    def held_requests(self) -> int:
        return len(self.sched.requests) - len(self.sched.waiting)

    # --- commands -------------------------------------------------------------------------

    def apply(self, command: Command) -> None:
        if isinstance(command, Prefill):
            req = self.request(command.tid, command.ids, command.params)
            req.cache_salt = command.cache_salt
            self.sched.add(req)
            self.stamps[command.tid] = _Stamps()
            if command.fault is not None:
                self.faults[command.tid] = command
        elif isinstance(command, Abort):
            self.abort(command)
        elif isinstance(command, ClearCache):
            self.kv.clear_cache()  # what requests hold stays; the rest is written back below
            if self.tiers is not None:
                if command.host:
                    self.tiers.clear_host()
                self.tiers.hierarchy.reap(wait=True)
                self.report_tiers(now=True)

    def abort(self, cmd: Abort) -> None:
        if self.sched.abort(cmd.tid, cmd.reason) is not None:  # not handed off yet: released now
            self.stamps.pop(cmd.tid, None)
        elif cmd.tid in self.delayed:  # held back (stall-transfer): never handed to the sender, release it now
            del self.delayed[cmd.tid]
            self.sender.abort(cmd.tid, cmd.reason)  # a decode rank that already asked for it hears at once
            stamps = self.stamps[cmd.tid]
            now = time.monotonic()
            why = f"aborted before it was sent: {cmd.reason}"
            self.release(cmd.tid, Sent(cmd.tid, False, why, 0, 0, (stamps.started, stamps.computed), (now, now)))
        elif self.sched.holds(cmd.tid):
            self.sender.abort(cmd.tid, cmd.reason)

    # --- one step -------------------------------------------------------------------------

    def tick(self) -> None:
        step = self.sched.next_step()
        if step is not None:
            self.run(step)
        for req in self.sched.take_finished():
            self.stamps.pop(str(req.rid), None)
            if self.rank == 0 and req.finish_reason is FinishReason.ERROR:
                self.conn.send(Failed(str(req.rid), req.error or "failed"))
        self.progress()
        self.report_tiers()

    def run(self, step: Step) -> None:
        now = time.monotonic()
        for req in step.reqs:
            self.crash_if_poison(str(req.rid))
            stamps = self.stamps[str(req.rid)]
            if not stamps.started:  # first scheduled: the router reserves its decode memory now
                stamps.started = now
                hit = req.hit
                if self.rank == 0:
                    cached, details = (0, ZERO_DETAILS) if hit is None else (hit.cached_tokens, hit.details)
                    self.conn.send(Started(str(req.rid), now, cached, details))
        out = self.runner.run_stage(step.batch)
        handed = self.sched.computed(step)
        for req in handed:  # this stage's KV/state is complete: send it while the later stages still compute
            self.stamps[str(req.rid)].computed = time.monotonic()
            self.hand_off(req)
        if not step.ending:
            return
        runner = self.runner
        rows = len(step.ending)
        logits = out[step.ending] if runner.last else torch.empty(rows, runner.model.vocab_size, dtype=runner.dtype)
        if self.size > 1:
            self.groups.broadcast_from_last(logits.contiguous())
        tokens = choose_step_tokens(step, logits)
        self.sched.chosen(step, tokens)
        if self.rank != 0:
            return
        at = time.monotonic()
        for req in handed:
            if req.finish_reason is FinishReason.ERROR:
                self.conn.send(Failed(str(req.rid), req.error or "failed"))
            else:
                assert req.tokens[-1] != NON_FINITE
                self.conn.send(First(str(req.rid), req.tokens[-1], at))

    def crash_if_poison(self, tid: str) -> None:
        """The ``crash-prefill`` fault: its stage raises while it computes the request (every attempt)."""
        fault = self.faults.get(tid)
        on_compute(None if fault is None else fault.fault, self.args.config.prefill_tp, self.rank, tid)

    def hand_off(self, req: Request) -> None:
        tid = str(req.rid)
        fault = self.faults.pop(tid, None)
        hand_off = on_hand_off(None if fault is None else fault.fault, self.args.config.prefill_tp, self.rank)
        if hand_off.hold_s:
            self.delayed[tid] = time.monotonic() + hand_off.hold_s
            return
        if hand_off.write_delay_s is not None and self.throttle is not None:
            self.throttle.delay_s = hand_off.write_delay_s
        self.send(req)

    def send(self, req: Request) -> None:
        tid = str(req.rid)
        self.stamps[tid].handed = time.monotonic()
        h = req.kv
        assert h is not None  # handed off: it holds its KV until its sender is done
        gate = self.kv.kvm.pin(h)
        self.sender.send(tid, h.pages, h.state_slot, h.seq_len, pinned=gate)
        self.conn.send(Sending(tid))

    def progress(self) -> None:
        now = time.monotonic()
        for tid, at in list(self.delayed.items()):
            if now >= at:
                del self.delayed[tid]
                self.send(self.sched.requests[tid])
        for report in self.sender.poll():
            tid = report.request_id
            if not self.sched.holds(tid):
                continue
            self.delayed.pop(tid, None)
            self.nbytes += report.nbytes
            self.requests += 1
            stamps = self.stamps[tid]
            done = report.finished_at or time.monotonic()  # the sender's end, not when this loop saw it
            sending = (stamps.handed or done, max(done, stamps.handed))
            ok = report.phase is Phase.SUCCESS
            compute = (stamps.started, stamps.computed)
            self.release(tid, Sent(tid, ok, report.reason, report.nbytes, report.ops, compute, sending))

    def release(self, tid: str, sent: Sent) -> None:
        """Its sender is done with it: unpin, cache the prompt, release the rest, report."""
        h = self.sched.requests[tid].kv
        assert h is not None  # handed off: it holds its KV until now
        self.kv.kvm.unpin(h)
        self.sched.release_sent(tid)
        self.stamps.pop(tid, None)
        self.report_tiers(now=True)  # before ``Sent``: the router sees the request's restore counted when it ends
        self.conn.send(sent)

    def report_tiers(self, now: bool = False) -> None:
        """Send this rank's tier counters if they changed: ``now``, or once ``FIGURES_S`` passed."""
        if self.tiers is None or not (now or time.monotonic() >= self.figures_due):
            return
        self.figures_due = time.monotonic() + FIGURES_S
        figures = self.tiers.metrics()
        if figures != self.figures_sent:
            self.figures_sent = figures
            self.conn.send(TierFigures(figures))

    def drain(self) -> None:
        for tid in list(self.delayed):
            del self.delayed[tid]
            self.send(self.sched.requests[tid])  # its decode side has long given up: the sender fails it at once
        for req in self.sched.held():
            self.sender.abort(str(req.rid), "the server is stopping")
        for req in [*self.sched.waiting, *self.sched.running]:
            self.sched.abort(req.rid, "the server is stopping")
        end = time.monotonic() + self.args.config.timeout_s
        while self.sched.held() and time.monotonic() < end:
            self.progress()
            time.sleep(0.002)
        if self.tiers is not None:  # closed first: the cache cleared below writes nothing back
            self.tiers.close()
            self.tiers = None
        self.kv.clear_cache()


def prefill_tiers(kv: RequestKV, c: PDConfig) -> EngineTiers | None:
    """This rank's tiers below its device (None without): its own host memory and store client,
    keyed by its shard (``tiers.keys``: its layer range, PP stage and TP rank), on the master the
    router named."""
    e = c.engine
    if not e.tiered:
        return None
    if e.store == "mooncake" and e.store_master is None:
        raise ValueError("a prefill rank's store needs the master the router started or was given (store_master)")
    tiers = e.tiers(kv.kvm)
    assert tiers is not None
    h = tiers.hierarchy
    bound = min(h.timeout_s, c.timeout_s / 4)  # a rank's wait on its store stays well inside its peers' collectives
    h.timeout_s = bound
    for tier in (h.host, h.store):
        if tier is not None:
            tier.timeout_s = min(tier.timeout_s, bound)
    return tiers


def prefill_main(rank: int, conn: Connection, args: WorkerArgs) -> None:
    worker = PrefillRank(rank, conn, args)
    try:
        worker.serve()
    finally:
        worker.close()
