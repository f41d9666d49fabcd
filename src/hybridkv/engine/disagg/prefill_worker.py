"""One prefill rank (PP stage x TP rank) of a disaggregated server: prefill, then hand over to the sender.

Every rank of the prefill world reads the same command stream (``Prefill`` / ``Abort`` /
``Probe`` / ``Stop``) from its pipe and runs requests one at a time in that order, so every
chunk's collectives (stage-to-stage hidden states, TP all-reduce) line up.

Per request: every rank matches the prompt in its own prefix cache and the world agrees on
the shortest hit (an all-reduce MIN, repeated until every rank matches exactly that long:
stages hold other pools, so their hits may differ); prefill computes from there in chunks
(ending where any rank wants a state checkpoint: every rank cuts the same chunks). As soon
as a stage has run its layers over the last chunk, it hands the request's *whole* KV/state
(cached pages included; the plan sends what the decode side needs: every page of
full-history pools, the window's pages of sliding ones, the slot of recurrent state) to its
sender, so its transfer overlaps the later stages' compute; only then do the ranks take the
first token from the last stage's logits (one broadcast per request, none per chunk). World
rank 0 reports ``Started`` (with the agreed hit) and ``First``; every rank reports ``Sent``
(with its compute and send windows).

Invariants:
- A request starts only when every rank can hold its whole prompt (free or evictable pages;
  an all-reduce MIN of each rank's answer); otherwise every rank drops it and rank 0 reports
  ``Failed`` (memory full), so no rank runs out of memory mid-prefill with its peers waiting.
- A request's pages and slot are held from admission until its sender reports it finished
  (success or failure); then ``finish`` caches its prompt (pages and checkpoints: the KV is
  valid whatever the transfer did) and releases the rest. Windows are not trimmed while the
  sender may read them (``mark_computed`` is never called here).
- At ``Stop`` the rank waits (bounded) for its sender's outstanding requests, empties its
  cache, checks ``mem.verify()`` and reports live (pages, slots) before and after.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist

from hybridkv.cache import PAGE_NEED
from hybridkv.engine.allocator import RequestAllocator, RequestMemory
from hybridkv.engine.batch import ForwardBatch
from hybridkv.engine.disagg.config import WorkerArgs, transport_options
from hybridkv.engine.disagg.protocol import (
    Abort,
    Failed,
    First,
    Live,
    Prefill,
    Probe,
    Ready,
    Report,
    Sending,
    Sent,
    Started,
    Stop,
)
from hybridkv.engine.parallel.groups import StageGroups
from hybridkv.engine.parallel.runner import ShardRunner
from hybridkv.memory import OutOfMemory, UnifiedMemory
from hybridkv.spec import Parallel
from hybridkv.transfer import Phase, PrefillSender, Transport, make_transport
from hybridkv.transfer.auth import ClusterKey
from hybridkv.transfer.transport.drills import Throttled


def live(mem: UnifiedMemory) -> tuple[int, int]:
    return int(mem.pages.capacity - mem.pages.free_count), int(mem.slots.capacity - mem.slots.free_count)


def batch_of(req: RequestMemory, ids: list[int], prefix: int) -> ForwardBatch:
    if req.slot is None:
        return ForwardBatch.build([ids], [prefix], [req.token_locs], None, None)
    return ForwardBatch.build([ids], [prefix], [req.token_locs], [req.slot], [req.fresh])


def _agreed(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t[0])


@dataclass
class _Held:
    """A prefilled request whose sender has not finished: its memory and stamps."""

    req: RequestMemory
    ids: tuple[int, ...]
    computed: tuple[float, float]  # prefill of this request on this rank: started, last chunk done
    handed: float = 0.0  # when it went to the sender (0: not yet)


class _Rank:
    def __init__(self, rank: int, conn: Connection, args: WorkerArgs) -> None:
        self.rank, self.conn, self.args = rank, conn, args
        c = args.config
        layout = Parallel(pp_size=c.prefill_pp, tp_size=c.prefill_tp)
        groups = StageGroups.create(layout, range(c.prefill_pp * c.prefill_tp), c.timeout_s)
        assert groups is not None  # every rank of this world is in the layout
        self.groups = groups
        self.runner = ShardRunner(
            c.model_dir,
            c.model_dir,
            self.groups.parallel,
            self.groups.pp_rank,
            self.groups.tp_rank,
            self.groups,
            gpu_memory=c.gpu_memory,
            page_size=c.page_size,
            chunk_size=c.chunk,
            max_context=c.max_context,
        )
        self.mem = self.runner.mem
        self.alloc = RequestAllocator(self.mem, prefix_cache=c.prefix_cache)
        self.before = live(self.mem)
        inner = make_transport(c.transport, None, **transport_options(c.transport))
        self.throttle: Throttled | None = None
        self.transport: Transport = inner
        if any(f.kind == "kill-prefill" for f in c.faults):  # writes slowed: the kill lands mid-transfer
            self.throttle = self.transport = Throttled(inner, 0.0)
        key = ClusterKey.from_hex(args.key_hex, "prefill worker")
        self.sender = PrefillSender(
            self.mem, args.engine, args.bootstrap, self.transport, key=key, timeout_s=c.timeout_s
        )
        self.held: dict[str, _Held] = {}
        self.delayed: dict[str, float] = {}  # tid -> when to hand it to the sender (stall-transfer)
        self.nbytes = 0
        self.requests = 0

    def close(self) -> None:
        self.sender.close()
        self.transport.close()

    def serve(self) -> None:
        self.conn.send(Ready(os.getpid(), "", self.before))
        while True:
            busy = bool(self.held)
            if self.conn.poll(0.002 if busy else 0.05):
                cmd = self.conn.recv()
                if isinstance(cmd, Stop):
                    break
                if isinstance(cmd, Prefill):
                    self.prefill(cmd)
                elif isinstance(cmd, Abort):
                    self.abort(cmd)
                elif isinstance(cmd, Probe):
                    pages, slots = live(self.mem)
                    cache = self.alloc.cache
                    held = len(self.held)
                    self.conn.send(Live(cmd.seq, (pages - cache.cached_pages, slots - cache.num_checkpoints), held))
            self.progress()
        self.drain()

    def prefill(self, cmd: Prefill) -> None:
        started = time.monotonic()
        ids = list(cmd.ids)
        req = self.alloc.new()
        cap = len(ids) - 1  # one token is always computed, for the first token's logits
        while True:
            local = self.alloc.kvm.match(np.asarray(ids[:cap], dtype=np.int64)).length if cap else 0
            agreed = _agreed(local)
            if agreed == cap:
                break
            cap = agreed
        if not _agreed(int(self.admit(req, ids, cap))):
            self.alloc.retract(req)
            if self.rank == 0:
                self.conn.send(
                    Failed(
                        cmd.tid,
                        f"prefill memory is full: a prompt of {len(ids)} tokens does not fit on every prefill "
                        f"rank beside the {len(self.held)} requests still being sent; retry later or raise gpu_memory",
                    )
                )
            return
        if self.rank == 0:
            self.conn.send(Started(cmd.tid, started, req.length))
        wanted: list[tuple[int, ...]] = [()] * dist.get_world_size()
        dist.all_gather_object(wanted, req.wanted)  # stages without recurrent layers want none: take every rank's
        ends = sorted(set().union(*wanted))
        start = req.length
        while start < len(ids):
            span = min(self.args.config.chunk, len(ids) - start)
            for p in ends:  # end the chunk where a state checkpoint is wanted (on any rank)
                if start < p < start + span:
                    span = p - start
                    break
            self.alloc.extend([req], [span])
            out = self.runner.run_stage(batch_of(req, ids[start : start + span], start))
            req.fresh = False  # window pages stay until the sender finished
            self.alloc.chunk_done(req, ids)
            start += span
            self.progress()  # earlier requests' senders may have finished: report them now
        computed = time.monotonic()
        self.held[cmd.tid] = _Held(req, cmd.ids, (started, computed))
        self.requests += 1
        # this stage's KV/state is complete: send it while the later stages still compute
        if cmd.fault == "stall-transfer":
            self.delayed[cmd.tid] = time.monotonic() + cmd.delay_s
        else:
            if cmd.fault == "kill-prefill" and self.throttle is not None:
                self.throttle.delay_s = cmd.delay_s
            self.hand_over(cmd.tid)
        runner = self.runner
        logits = out if runner.last else torch.empty(1, runner.model.vocab_size, dtype=runner.dtype)
        self.groups.broadcast_from_last(logits.contiguous())
        if self.rank == 0:
            self.conn.send(First(cmd.tid, int(torch.argmax(logits[0])), time.monotonic()))

    def admit(self, req: RequestMemory, ids: list[int], cap: int) -> bool:
        """Admit ``req`` at the agreed hit ``cap`` if every page its prompt needs is free or evictable
        (pages the senders still read are neither); False (nothing held) otherwise."""
        try:
            self.alloc.admit(req, ids[: cap + 1], len(ids), self.args.config.chunk, 0, force=True)
        except OutOfMemory:
            return False
        need = req.live.pages_needed(len(ids))
        short = need - self.mem.available_pages()
        if short > 0:
            self.alloc.kvm.evict({PAGE_NEED: short})
        return need <= self.mem.available_pages()

    def hand_over(self, tid: str) -> None:
        if tid not in self.held:  # its decode side gave up and the sender already reported it
            return
        held = self.held[tid]
        held.handed = time.monotonic()
        self.sender.send(tid, held.req.live.pages, held.req.slot, held.req.length)
        self.conn.send(Sending(tid))

    def abort(self, cmd: Abort) -> None:
        if cmd.tid in self.delayed:  # held back (stall-transfer): never handed to the sender, release it now
            del self.delayed[cmd.tid]
            self.sender.abort(cmd.tid, cmd.reason)  # a decode rank that already asked for it hears at once
            held = self.held.pop(cmd.tid)
            self.alloc.finish(held.req, held.ids)
            now = time.monotonic()
            self.conn.send(
                Sent(cmd.tid, False, f"aborted before it was sent: {cmd.reason}", 0, 0, held.computed, (now, now))
            )
        elif cmd.tid in self.held:
            self.sender.abort(cmd.tid, cmd.reason)

    def progress(self) -> None:
        now = time.monotonic()
        for tid, at in list(self.delayed.items()):
            if now >= at:
                del self.delayed[tid]
                self.hand_over(tid)
        for report in self.sender.poll():
            held = self.held.pop(report.request_id, None)
            if held is None:
                continue
            self.delayed.pop(report.request_id, None)
            self.alloc.finish(held.req, held.ids)
            ok = report.phase is Phase.SUCCESS
            self.nbytes += report.nbytes
            done = report.finished_at or time.monotonic()  # the sender's end, not when this loop saw it
            sending = (held.handed or done, max(done, held.handed))
            self.conn.send(
                Sent(report.request_id, ok, report.reason, report.nbytes, report.ops, held.computed, sending)
            )

    def drain(self) -> None:
        for tid in list(self.delayed):
            del self.delayed[tid]
            self.hand_over(tid)  # its decode side has long given up: the sender fails it at once
        for tid in self.held:
            self.sender.abort(tid, "the server is stopping")
        end = time.monotonic() + self.args.config.timeout_s
        while self.held and time.monotonic() < end:
            self.progress()
            time.sleep(0.002)
        self.alloc.clear_cache()
        self.mem.verify()
        self.conn.send(Report(self.before, live(self.mem), self.nbytes, self.requests))


def prefill_main(rank: int, conn: Connection, args: WorkerArgs) -> None:
    worker = _Rank(rank, conn, args)
    try:
        worker.serve()
    finally:
        worker.close()
