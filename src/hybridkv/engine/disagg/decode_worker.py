"""One decode TP rank of a disaggregated server: reserve, receive, then decode in continuous batches.

Only TP rank 0 reads commands (``Reserve`` / ``Decode`` / ``Abort`` / ``Stop``) from the
router; at every step boundary it broadcasts what it read to its TP peers, so every rank
applies the same commands at the same step. ``Reserve`` asks the prefill engine for the
request's KV (``DecodeReceiver.request``: pages and slot reserved, the transfer timer
starts); once a request's first token is known (``Decode``), the ranks agree each step, by
one all-reduce, whether every rank holds every prefill rank's KV (then all adopt it and it
joins the running batch) or any rank's transfer failed (then all drop it: ``Failed`` with
the failing rank's reason). Every running request decodes one token per step, all in one
batch (TP all-reduce inside the layers); a request ends after ``max_new`` tokens.

Invariants:
- A request decodes only after every decode rank got Success from every prefill rank.
- The TP ranks' memories are equal (same plan, same shard sizes) and apply the same commands
  in the same order, so a reservation fails on every rank or on none, and so does a step's
  growth: when the running batch cannot grow by one token, every rank drops its newest
  request (``Failed``: decode memory is full) and steps without it.
- Every reservation ends in exactly one of: adopted then retracted (finished or aborted),
  or failed in the receiver (its pages quarantined until every writer stopped or is proven
  gone, then freed by ``poll``). At ``Stop`` the rank drains (bounded), checks
  ``mem.verify()`` and reports live (pages, slots) before and after.
- An idle leader still broadcasts every ``IDLE_S`` seconds, well inside the collective
  timeout, so an idle engine never times out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from hybridkv.engine.allocator import RequestAllocator, RequestMemory
from hybridkv.engine.batch import ForwardBatch
from hybridkv.engine.disagg.config import WorkerArgs, transport_options
from hybridkv.engine.disagg.prefill_worker import live
from hybridkv.engine.disagg.protocol import (
    Abort,
    Admitted,
    Command,
    Decode,
    Done,
    Failed,
    Live,
    Probe,
    Ready,
    Report,
    Reserve,
    Stop,
)
from hybridkv.engine.engine import engine_spec
from hybridkv.engine.parallel.groups import StageGroups
from hybridkv.engine.parallel.runner import ShardRunner
from hybridkv.engine.registry import text_config
from hybridkv.engine.weights import read_config
from hybridkv.memory import OutOfMemory, UnifiedMemory
from hybridkv.spec import Parallel, ShardSpec
from hybridkv.transfer import Allocation, DecodeReceiver, Phase, SharedBuffer, make_transport, shared_memory
from hybridkv.transfer.auth import ClusterKey

IDLE_S = 0.05


@dataclass
class _Pending:
    seq_len: int
    alloc: Allocation
    first: int | None = None
    max_new: int = 0


@dataclass
class _Running:
    tid: str
    req: RequestMemory
    max_new: int
    nbytes: int  # received by this rank
    tokens: list[int] = field(default_factory=list)


class _Rank:
    def __init__(self, rank: int, conn: Connection, args: WorkerArgs) -> None:
        self.rank, self.conn, self.args = rank, conn, args
        c = args.config
        groups = StageGroups.create(Parallel(tp_size=c.decode_tp), range(c.decode_tp), c.timeout_s)
        assert groups is not None  # every rank of this world is in the layout
        self.groups = groups
        spec = engine_spec(text_config(read_config(c.model_dir)))
        shard = ShardSpec(spec, self.groups.parallel, 0, rank)
        hints = {"page_size": c.decode_page, "max_context": c.max_context, "chunk_tokens": c.chunk}
        self.shared: SharedBuffer | None = None
        if c.transport == "shm":
            self.mem, self.shared = shared_memory(shard, c.gpu_memory, **hints)
            self.link = make_transport("shm", self.shared)
        else:
            self.mem = UnifiedMemory.create(shard, c.gpu_memory, **hints)  # type: ignore[arg-type]
            self.link = make_transport(c.transport, None, **transport_options(c.transport))
        self.runner = ShardRunner(
            c.model_dir, c.model_dir, self.groups.parallel, 0, rank, self.groups, spec=spec, mem=self.mem
        )
        key = ClusterKey.from_hex(args.key_hex, "decode worker")
        self.receiver = DecodeReceiver(
            self.mem, args.engine, args.bootstrap, self.link, key=key, timeout_s=c.transfer_timeout_s
        )
        self.alloc = RequestAllocator(self.mem, prefix_cache=False)
        self.before = live(self.mem)
        self.pending: dict[str, _Pending] = {}
        self.running: list[_Running] = []
        self.nbytes = 0
        self.requests = 0

    def close(self) -> None:
        self.receiver.close()
        self.link.close()
        if self.shared is not None:
            self.shared.close()

    def serve(self) -> None:
        self.conn.send(Ready(os.getpid(), self.shared.path if self.shared is not None else "", self.before))
        while True:
            commands = self.commands()
            if any(isinstance(c, Stop) for c in commands):
                break
            for command in commands:
                self.apply(command)
            self.receiver.poll()
            self.admit()
            self.step()
        self.drain()

    def commands(self) -> list[Command]:
        """What the leader read since the last step, on every rank."""
        out: list[Command] = []
        if self.rank == 0:
            wait = 0.0 if self.running else (0.002 if self.pending else IDLE_S)
            if self.conn.poll(wait):
                while self.conn.poll(0):
                    out.append(self.conn.recv())
        if self.args.config.decode_tp == 1:
            return out
        box: list[object] = [out]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def apply(self, command: Command) -> None:
        if isinstance(command, Probe):
            self.receiver.poll()
            self.conn.send(Live(command.seq, live(self.mem), self.receiver.held + len(self.running)))
        elif isinstance(command, Reserve):
            try:
                got = self.receiver.request(command.tid, command.prefill_engine, command.seq_len)
            except OutOfMemory as exc:  # nothing reserved
                reason = f"decode memory is full: TP rank {self.rank} cannot reserve {command.seq_len} tokens ({exc})"
                self.conn.send(Failed(command.tid, reason))
                return
            self.pending[command.tid] = _Pending(command.seq_len, got)
        elif isinstance(command, Decode) and command.tid in self.pending:
            p = self.pending[command.tid]
            p.first, p.max_new = command.first, command.max_new
        elif isinstance(command, Abort):
            if command.tid in self.pending:
                del self.pending[command.tid]
                self.receiver.abort(command.tid, command.reason)
            for r in [r for r in self.running if r.tid == command.tid]:
                self.running.remove(r)
                self.alloc.retract(r.req)

    def admit(self) -> None:
        """Agree with the TP peers on which transfers ended, then adopt (all succeeded) or drop them."""
        ready = [tid for tid, p in self.pending.items() if p.first is not None]
        if not ready:
            return
        reports = [self.receiver.status(tid) for tid in ready]
        flags = torch.tensor(
            [
                [
                    int(r is not None and r.phase is Phase.SUCCESS),
                    int(r is not None and r.phase is Phase.FAILED),
                    r.nbytes if r is not None and r.phase is Phase.SUCCESS else 0,
                ]
                for r in reports
            ],
            dtype=torch.int64,
        )
        if self.args.config.decode_tp > 1:
            dist.all_reduce(flags)
        for tid, report, (ok, failed, nbytes) in zip(ready, reports, flags.tolist(), strict=True):
            p = self.pending[tid]
            if failed:
                del self.pending[tid]
                if report is not None and report.phase is Phase.SUCCESS:
                    req = self.alloc.new()  # the KV landed here: adopt it to free it through the allocator
                    self.alloc.adopt(req, p.alloc.pages, p.seq_len, p.alloc.slot)
                    self.alloc.retract(req)
                elif report is not None and report.phase is Phase.FAILED:
                    self.conn.send(Failed(tid, f"decode TP rank {self.rank}: {report.reason}"))
                else:
                    self.receiver.abort(tid, "another decode TP rank's transfer failed")
            elif ok == self.args.config.decode_tp:
                del self.pending[tid]
                req = self.alloc.new()
                self.alloc.adopt(req, p.alloc.pages, p.seq_len, p.alloc.slot)
                self.nbytes += report.nbytes if report is not None else 0
                self.requests += 1
                if self.rank == 0:
                    self.conn.send(Admitted(tid, time.monotonic(), nbytes))
                got = report.nbytes if report is not None else 0
                self.running.append(_Running(tid, req, p.max_new, got, [p.first]))  # type: ignore[list-item]
        self.finish()

    def step(self) -> None:
        while self.running:
            reqs = [r.req for r in self.running]
            prefix = [r.length for r in reqs]
            try:
                self.alloc.extend(reqs, [1] * len(reqs))
                break
            except OutOfMemory as exc:  # nothing grew: give up the newest request, try again without it
                newest = self.running.pop()
                self.alloc.retract(newest.req)
                reason = (
                    f"decode memory is full: TP rank {self.rank} cannot grow {len(reqs)} running requests by "
                    f"one token ({exc}); retry later or raise gpu_memory"
                )
                self.conn.send(Failed(newest.tid, reason))
        if not self.running:
            return
        has_state = self.alloc.has_state
        batch = ForwardBatch.build(
            [r.tokens[-1:] for r in self.running],
            prefix,
            [r.token_locs for r in reqs],
            [r.slot or 0 for r in reqs] if has_state else None,
            [r.fresh for r in reqs] if has_state else None,
        )
        logits = self.runner.forward(batch)
        self.alloc.mark_computed(reqs)
        for r, token in zip(self.running, torch.argmax(logits, dim=-1).tolist(), strict=True):
            r.tokens.append(int(token))
        self.finish()

    def finish(self) -> None:
        for r in [r for r in self.running if len(r.tokens) >= r.max_new]:
            self.running.remove(r)
            self.alloc.retract(r.req)
            self.conn.send(Done(r.tid, tuple(r.tokens), time.monotonic(), r.nbytes))

    def drain(self) -> None:
        for tid in list(self.pending):
            del self.pending[tid]
            self.receiver.abort(tid, "the server is stopping")
        for r in self.running:
            self.alloc.retract(r.req)
        self.running.clear()
        end = time.monotonic() + self.args.config.timeout_s
        while self.receiver.held and time.monotonic() < end:
            self.receiver.poll()
            time.sleep(0.002)
        self.mem.verify()
        self.conn.send(Report(self.before, live(self.mem), self.nbytes, self.requests))


def decode_main(rank: int, conn: Connection, args: WorkerArgs) -> None:
    worker = _Rank(rank, conn, args)
    try:
        worker.serve()
    finally:
        worker.close()
