"""One decode TP rank of a disaggregated server: a ``Scheduler`` in the decode role + a receiver.

``Reserve`` queues a request (its prompt and ``SamplingParams``); the scheduler reserves its
memory through ``KVManager`` (a RECEIVING handle nothing can read, match or evict) on every
rank or on none, in arrival order, as soon as it fits, and the receiver asks the prefill engine
for its KV into exactly those pages and that slot. Once its first token is known (``Decode``),
the ranks agree each step, by one all-reduce, whether every rank holds every prefill rank's
KV (then ``received``: it joins the running batch) or any rank's transfer failed (then every
rank drops it: ``Failed`` with the failing rank's reason). Running requests decode in
continuous batches with their sampling parameters, EOS and stop ids; when the batch cannot grow
the newest request is retracted and later prefilled again locally from its prompt and the
tokens it has (its output stays exact). World rank 0 streams each step's tokens (``Tokens``);
every rank reports ``Done`` (the router checks that they agree).

Invariants:
- A request decodes only after every decode rank got Success from every prefill rank.
- One owner, one free path: a reservation is released only through the scheduler (a failed
  transfer's pages once the receiver says no writer can touch them: ``take_releasable``).
- Every memory-dependent decision (reservation, admission, growth) is agreed over the TP ranks.
- A request's state is its ``status``: queued for memory (``WAITING``, in ``unreserved``: arrival order), reserved
  (``RECEIVING``; ``Request.first`` once its first token is known), running, or given up (``ABANDONED``: held
  until the receiver says no writer can touch its memory, ``Request.writers_gone``, then dropped).
- A held request's status changes only by agreed decisions or commands every rank sees (a transfer failed on one
  rank stays held there until the ranks agree on it), so every rank takes part in the same agreements.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from multiprocessing.connection import Connection

from hybridkv.engine.disagg.config import WorkerArgs
from hybridkv.engine.disagg.protocol import Abort, Admitted, Command, Decode, Done, Failed, Reserve, Tokens
from hybridkv.engine.disagg.worker import Worker
from hybridkv.engine.parallel.groups import StageGroups
from hybridkv.engine.registry import engine_spec, eos_ids, text_config
from hybridkv.engine.runner import build_runner
from hybridkv.engine.sched.kv import RequestKV
from hybridkv.engine.sched.request import FinishReason, Request, RequestStatus
from hybridkv.engine.sched.scheduler import Role, choose_step_tokens
from hybridkv.engine.weights import read_config
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import Parallel, ShardSpec
from hybridkv.transfer import Allocation, DecodeReceiver, Phase, SharedBuffer, shared_memory
from hybridkv.transfer.auth import ClusterKey
from hybridkv.transfer.transport import transport_class


class DecodeRank(Worker):
    role = Role.DECODE

    def __init__(self, rank: int, conn: Connection, args: WorkerArgs) -> None:
        c = args.config
        super().__init__(rank, conn, args, c.decode_tp)
        groups = StageGroups.create(Parallel(tp_size=c.decode_tp), range(c.decode_tp), c.timeout_s)
        assert groups is not None  # every rank of this world is in the layout
        config = text_config(read_config(c.model_dir))
        spec = engine_spec(config, c.engine.dtype)
        self.eos = eos_ids(config)
        shard = ShardSpec(spec, groups.parallel, 0, rank)
        hints = {"page_size": c.decode_page, "max_context": c.max_context, "chunk_tokens": c.engine.chunk_size}
        self.shared: SharedBuffer | None = None
        kind = transport_class(c.transport)
        if kind.shared_arena:
            self.mem, self.shared = shared_memory(shard, c.engine.memory_bytes, args.shm_tokens[rank], **hints)
        else:
            self.mem = UnifiedMemory.create(shard, c.engine.memory_bytes, **hints)  # type: ignore[arg-type]
        self.link = kind.create(self.shared, **kind.loopback_options)
        runs = dataclasses.replace(c.engine, spec=spec)  # the spec the memory was built from
        self.runner = build_runner(c.model_dir, c.model_dir, runs, groups.parallel, 0, rank, groups, mem=self.mem)
        key = ClusterKey.from_hex(args.key_hex, "decode worker")
        self.receiver = DecodeReceiver(
            self.mem, args.engine, args.bootstrap, self.link, key=key, timeout_s=c.transfer_timeout_s
        )
        self.kv = RequestKV(self.mem, prefix_cache=False)
        self.sched = self.scheduler()
        self.unreserved: deque[tuple[Request, str]] = deque()
        """(request, prefill engine) waiting for memory, in arrival order: a queue, as ``Scheduler.waiting``."""
        self.received: dict[str, int] = {}  # tid -> bytes this rank received for it

    def close(self) -> None:
        self.receiver.close()
        self.link.close()
        if self.shared is not None:
            self.shared.close()

    def poll_s(self) -> float:
        return 0.002 if self.unreserved and not self.sched.has_work() else super().poll_s()

    def held_requests(self) -> int:
        return len(self.sched.requests)

    # --- commands -------------------------------------------------------------------------

    def apply(self, command: Command) -> None:
        if isinstance(command, Reserve):
            self.unreserved.append((self.request(command.tid, command.ids, command.params), command.prefill_engine))
        elif isinstance(command, Decode):
            req = self.find(command.tid)
            if req is not None:
                req.first = command.first
        elif isinstance(command, Abort):
            self.abort(command.tid, command.reason)

    def find(self, tid: str) -> Request | None:
        """The open request ``tid``: queued for memory, or the scheduler's."""
        for req, _ in self.unreserved:
            if req.rid == tid:
                return req
        return self.sched.requests.get(tid)

    def abort(self, tid: str, reason: str) -> None:
        for entry in self.unreserved:
            if entry[0].rid == tid:
                self.unreserved.remove(entry)
                return
        if self.sched.holds(tid):
            self.receiver.abort(tid, reason)  # released once no writer can touch its pages
            self.sched.abandon(tid)
        else:
            self.sched.abort(tid, reason)

    # --- one step -------------------------------------------------------------------------

    def tick(self) -> None:
        self.reserve()
        self.admit()
        step = self.sched.next_step()
        if step is not None:
            logits = self.runner.forward(step.batch)
            tokens = choose_step_tokens(step, logits)
            self.sched.complete(step, tokens)
            chosen = tuple((str(r.rid), t) for r, t in zip(step.reqs, tokens, strict=True) if t is not None)
            if self.rank == 0 and chosen:
                self.conn.send(Tokens(chosen))
        self.report_finished()

    def reserve(self) -> None:
        """Reserve memory for queued requests in arrival order, while they fit on every rank."""
        while self.unreserved:
            req, engine = self.unreserved[0]
            if not self.sched.reserve(req):
                if not self.sched.alone_in_memory:
                    return  # it fits once running requests end
                self.unreserved.popleft()
                if self.rank == 0:
                    self.conn.send(
                        Failed(
                            str(req.rid),
                            f"decode memory is full: a prompt of {len(req.prompt)} tokens does not fit the "
                            f"decode memory budget even alone; raise gpu_memory",
                        )
                    )
                continue
            self.unreserved.popleft()
            h = req.kv
            assert h is not None  # reserved
            self.receiver.request(str(req.rid), engine, len(req.prompt), reserved=Allocation(h.pages, h.state_slot))

    def admit(self) -> None:
        """Agree with the TP peers on which transfers ended, then run (all succeeded) or drop them."""
        ready = [str(r.rid) for r in self.sched.held() if r.status is RequestStatus.RECEIVING and r.first is not None]
        reports = [self.receiver.status(tid) for tid in ready]
        self.collect()  # after reading: every status read has had its pages unpinned or quarantined
        if not ready:
            return
        flags: list[int] = []
        for r in reports:
            flags += [int(r is not None and r.phase is Phase.SUCCESS), -int(r is not None and r.phase is Phase.FAILED)]
        agreed = self.agree.min(flags)
        for k, (tid, report) in enumerate(zip(ready, reports, strict=True)):
            ok, failed = agreed[2 * k], -agreed[2 * k + 1]
            if failed:
                self.sched.abandon(tid)
                if report is not None and report.phase is Phase.FAILED:
                    self.conn.send(Failed(tid, f"decode TP rank {self.rank}: {report.reason}", transfer=True))
                elif report is not None and report.phase is Phase.SUCCESS:
                    self.sched.drop(tid)  # another decode TP rank's transfer failed; nothing writes here any more
                else:
                    self.receiver.abort(tid, "another decode TP rank's transfer failed")
            elif ok:
                assert report is not None
                self.received[tid] = report.nbytes
                self.nbytes += report.nbytes
                self.requests += 1
                if self.rank == 0:
                    self.conn.send(Admitted(tid, time.monotonic(), report.nbytes))
                first = self.sched.requests[tid].first
                assert first is not None  # ready
                self.sched.received(tid, first)

    def collect(self) -> None:
        """The receiver's finished requests: unpin the successful, drop the failed ones once no
        writer can touch their pages, and those given up whose KV landed anyway (an abort that came
        after the transfer succeeded frees nothing in the receiver)."""
        given_up = [str(r.rid) for r in self.sched.held() if r.status is RequestStatus.ABANDONED]
        landed = [t for t in given_up if self._phase(t) is Phase.SUCCESS]  # read before poll: unpinned by it
        self.receiver.poll()
        for tid in self.receiver.take_releasable():
            req = self.sched.requests.get(tid)
            if req is not None:
                req.writers_gone = True
        for req in self.sched.held():  # the others: failed here, not agreed yet (still held)
            if req.status is RequestStatus.ABANDONED and req.writers_gone:
                self.sched.drop(req.rid)  # its transfer failed
        for tid in landed:
            self.sched.drop(tid)  # given up

    def report_finished(self) -> None:
        for req in self.sched.take_finished():
            tid = str(req.rid)
            nbytes = self.received.pop(tid, 0)
            if req.finish_reason is FinishReason.ERROR:
                if self.rank == 0:
                    self.conn.send(Failed(tid, req.error or "failed"))
            elif req.finish_reason is not FinishReason.ABORT:
                assert req.finish_reason is not None  # it is finished
                at = time.monotonic()
                self.conn.send(Done(tid, tuple(req.output), req.finish_reason, at, nbytes, req.retractions))

    def _phase(self, tid: str) -> Phase | None:
        report = self.receiver.status(tid)
        return None if report is None else report.phase

    def drain(self) -> None:
        self.unreserved.clear()
        for req in self.sched.held():
            self.receiver.abort(str(req.rid), "the server is stopping")
            self.sched.abandon(req.rid)
        for req in [*self.sched.waiting, *self.sched.running]:
            self.sched.abort(req.rid, "the server is stopping")
        end = time.monotonic() + self.args.config.timeout_s
        while self.sched.held() and time.monotonic() < end:
            self.collect()
            time.sleep(0.002)
        self.sched.take_finished()


def decode_main(rank: int, conn: Connection, args: WorkerArgs) -> None:
    worker = DecodeRank(rank, conn, args)
    try:
        worker.serve(worker.shared.path if worker.shared is not None else "")
    finally:
        worker.close()
