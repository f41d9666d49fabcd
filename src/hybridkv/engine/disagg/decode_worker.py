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
- ``holding`` changes only by agreed decisions (a transfer failed on one rank stays held there until
  the ranks agree on it), so every rank takes part in the same agreements.
"""

from __future__ import annotations

import time
from collections import deque
from multiprocessing.connection import Connection

from hybridkv.engine.disagg.config import WorkerArgs
from hybridkv.engine.disagg.protocol import Abort, Admitted, Command, Decode, Done, Failed, Reserve, Tokens
from hybridkv.engine.disagg.worker import Worker
from hybridkv.engine.parallel.groups import StageGroups
from hybridkv.engine.registry import engine_spec, eos_ids, text_config
from hybridkv.engine.runner import build_runner
from hybridkv.engine.sched.allocator import RequestAllocator
from hybridkv.engine.sched.request import FinishReason
from hybridkv.engine.sched.scheduler import Request, Role, choose_step_tokens
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
        spec = engine_spec(config, c.torch_dtype)
        self.eos = eos_ids(config)
        shard = ShardSpec(spec, groups.parallel, 0, rank)
        hints = {"page_size": c.decode_page, "max_context": c.max_context, "chunk_tokens": c.chunk}
        self.shared: SharedBuffer | None = None
        kind = transport_class(c.transport)
        if kind.shared_arena:
            self.mem, self.shared = shared_memory(shard, c.gpu_memory, args.shm_tokens[rank], **hints)
        else:
            self.mem = UnifiedMemory.create(shard, c.gpu_memory, **hints)  # type: ignore[arg-type]
        self.link = kind.create(self.shared, **kind.loopback_options)
        self.runner = build_runner(
            c.model_dir, c.model_dir, groups.parallel, 0, rank, groups, dtype=c.torch_dtype, spec=spec, mem=self.mem
        )
        key = ClusterKey.from_hex(args.key_hex, "decode worker")
        self.receiver = DecodeReceiver(
            self.mem, args.engine, args.bootstrap, self.link, key=key, timeout_s=c.transfer_timeout_s
        )
        self.alloc = RequestAllocator(self.mem, prefix_cache=False)
        self.sched = self.scheduler()
        self.unreserved: deque[tuple[Request, str]] = deque()  # (request, prefill engine), waiting for memory
        self.first: dict[str, int] = {}
        self.received: dict[str, int] = {}  # tid -> bytes this rank received for it
        self.transfer_failed: set[str] = set()  # dropped for a failed transfer: the failing rank said why
        self.released: set[str] = set()  # failed here and out of quarantine, not yet agreed: still held

    def close(self) -> None:
        self.receiver.close()
        self.link.close()
        if self.shared is not None:
            self.shared.close()

    def poll_s(self) -> float:
        return 0.002 if self.unreserved and not self.sched.has_work() else super().poll_s()

    def held_requests(self) -> int:
        return len(self.sched.running) + len(self.sched.holding) + len(self.sched.waiting)

    # --- commands -------------------------------------------------------------------------

    def apply(self, command: Command) -> None:
        if isinstance(command, Reserve):
            req = self.request(command.tid, command.ids, command.params)
            self.unreserved.append((req, command.prefill_engine))
        elif isinstance(command, Decode):
            self.first[command.tid] = command.first
        elif isinstance(command, Abort):
            self.abort(command.tid, command.reason)

    def abort(self, tid: str, reason: str) -> None:
        self.first.pop(tid, None)
        for entry in self.unreserved:
            if entry[0].rid == tid:
                self.unreserved.remove(entry)
                return
        if tid in self.sched.holding:
            self.receiver.abort(tid, reason)  # released once no writer can touch its pages
            self.transfer_failed.add(tid)
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
            h = req.mem.handle
            assert h is not None
            self.receiver.request(str(req.rid), engine, len(req.prompt), reserved=Allocation(h.pages, h.state_slot))

    def admit(self) -> None:
        """Agree with the TP peers on which transfers ended, then run (all succeeded) or drop them."""
        ready = [t for t in map(str, self.sched.holding) if t in self.first and t not in self.transfer_failed]
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
                self.first.pop(tid)
                self.transfer_failed.add(tid)
                if report is not None and report.phase is Phase.FAILED:
                    self.conn.send(Failed(tid, f"decode TP rank {self.rank}: {report.reason}", transfer=True))
                elif report is not None and report.phase is Phase.SUCCESS:
                    self.sched.drop(tid, "another decode TP rank's transfer failed")  # nothing writes here any more
                else:
                    self.receiver.abort(tid, "another decode TP rank's transfer failed")
            elif ok:
                assert report is not None
                self.received[tid] = report.nbytes
                self.nbytes += report.nbytes
                self.requests += 1
                if self.rank == 0:
                    self.conn.send(Admitted(tid, time.monotonic(), report.nbytes))
                self.sched.received(tid, self.first.pop(tid))

    def collect(self) -> None:
        """The receiver's finished requests: unpin the successful, drop the failed ones once no
        writer can touch their pages, and those given up whose KV landed anyway (an abort that came
        after the transfer succeeded frees nothing in the receiver)."""
        given_up = [t for t in map(str, self.sched.holding) if t in self.transfer_failed]
        landed = [t for t in given_up if self._phase(t) is Phase.SUCCESS]  # read before poll: unpinned by it
        self.receiver.poll()
        self.released.update(self.receiver.take_releasable())
        for tid in [t for t in self.released if t in self.transfer_failed]:  # the others: not agreed yet
            self.released.discard(tid)
            self.sched.drop(tid, "its transfer failed")
        for tid in landed:
            self.sched.drop(tid, "given up")

    def report_finished(self) -> None:
        for req in self.sched.take_finished():
            tid = str(req.rid)
            nbytes = self.received.pop(tid, 0)
            if tid in self.transfer_failed:
                self.transfer_failed.discard(tid)
            elif req.finish_reason is FinishReason.ERROR:
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
        for rid in list(self.sched.holding):
            self.receiver.abort(str(rid), "the server is stopping")
            self.transfer_failed.add(str(rid))
        for req in [*self.sched.waiting, *self.sched.running]:
            self.sched.abort(req.rid, "the server is stopping")
        end = time.monotonic() + self.args.config.timeout_s
        while self.sched.holding and time.monotonic() < end:
            self.collect()
            time.sleep(0.002)
        self.sched.take_finished()


def decode_main(rank: int, conn: Connection, args: WorkerArgs) -> None:
    worker = DecodeRank(rank, conn, args)
    try:
        worker.serve(worker.shared.path if worker.shared is not None else "")
    finally:
        worker.close()
