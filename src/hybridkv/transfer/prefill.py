"""PrefillSender: one prefill rank writes its share of finished requests into decode ranks.

Protocol (this side): register at the bootstrap; every decode rank says ``Hello`` once
(its layout and transport session: the pairing is checked then) and sends one
``TransferRequest`` per request (its destination cells). The destination side of each
leg's plan is prepared as its request arrives (``Route.prepare``: the decode cells checked,
laid out and ordered while the prefill's forward still runs; a refusal fails the leg then).
When the owner hands over the request's pages with ``send``, each decode rank's *leg* runs
on the worker: complete the plan with the source cells (``Route.complete``), write in
chunks (``write_plan``: submit one, wait for it; over a transport that pays per op, each
chunk's strided sources are first gathered into a staging buffer, ``SourceStaging``, so it
goes out as one op per destination run), checksum; the decode rank gets ``transferring``
then ``success``/``failed`` (``LegStatus``).

Invariants:
- A decode rank's identity (endpoint, transport session, layout), once it said ``Hello``,
  is replaced only by a ``Hello`` from a newer epoch of that rank (a restart: the old
  incarnation's requests fail); a different ``Hello`` from the same or an older epoch is
  refused with a log line. Its requests, aborts and heartbeats count only from the epoch
  that said hello. A ``Hello`` whose endpoint is not ``tcp://host:port`` is refused; one
  whose session the transport refuses (``Transport.check_session``: e.g. a shm path
  outside hybridkv's own files) makes the rank unservable before anything is opened.
- The request's pages and slot are pinned by the owner's memory move gate (``send`` refuses one
  that does not hold them all) until the owner collects the finished request with ``poll``; a
  request is reported there only once no leg can still read them. The sender never pins or
  unpins: the owner does.
- Every decode rank of the requesting engine sends a request, even one this rank feeds
  nothing (it gets a zero-op success): the request succeeds here only when all of them
  succeeded, and fails on the first failure, abort, timeout or silent peer.
- A running leg checks its stop flag and its decode-given deadline between chunks and while
  one is in flight, so an aborted or expired request stops writing at the next chunk
  boundary; the leg ends only when no submitted chunk can still read its pages. Every
  failure is reported to every decode rank still waiting, with its reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Unpack

import numpy as np

from hybridkv.memory import GateStatus, MoveGate, UnifiedMemory
from hybridkv.transfer.agent import Agent, AgentOptions, EventKind, check_endpoint, log
from hybridkv.transfer.bootstrap import bootstrap_call
from hybridkv.transfer.buffers import BufferSet
from hybridkv.transfer.checksum import checksum_addresses
from hybridkv.transfer.errors import BadLayout, LayoutMismatch, PlanError, TransferError
from hybridkv.transfer.liveness import this_process
from hybridkv.transfer.messages import (
    Abort,
    Heartbeat,
    Hello,
    Message,
    Rank,
    Register,
    RegisterAck,
    Status,
    TransferRequest,
)
from hybridkv.transfer.pairing import pair_entries
from hybridkv.transfer.plan import Destination, Route, memory_cells, num_pages
from hybridkv.transfer.status import LegReport, LegStatus, Phase, RequestStatus, StatusReport
from hybridkv.transfer.transport import Transport
from hybridkv.transfer.transport.staging import SourceStaging
from hybridkv.transfer.transport.writer import write_plan

FINISHED_KEEP_S = 120.0
WAITING_GRACE_S = 1.0
"""A leg still waiting for the KV at the decode's deadline is dropped this much later: the
decode rank fails the request itself at its deadline and says why (its abort arrives
first); no byte is written after the deadline either way."""


@dataclass
class _DecodePeer:
    rank: Rank
    endpoint: str
    session: str
    buffers: BufferSet
    route: Route | None  # None when ``error`` says why this decode rank cannot be served
    error: str
    last_seen: float
    epoch: int  # the epoch that said hello: only its messages count


@dataclass
class _Leg:
    peer: _DecodePeer
    nonce: int
    seq_len: int
    dst_cells: dict[str, list[int]]  # as the decode rank's message gave them (plans of few pieces read lists)
    checksum: bool
    deadline: float
    dest: Destination | None = None  # the plan's destination side, prepared when the request arrived
    status: LegStatus = LegStatus.ASKED  # I/O thread only; TRANSFERRING while the worker runs it
    stop_reason: str = ""  # set by the I/O thread, read by the worker between chunks

    def enter(self, status: LegStatus) -> None:
        if not self.status.can_enter(status):
            raise RuntimeError(f"leg to {self.peer.rank}: {self.status} -> {status} moves backwards (bug)")
        self.status = status


@dataclass
class _Outgoing:
    status: RequestStatus
    deadline: float
    cells: dict[str, np.ndarray] | None = None
    seq_len: int = 0
    engine: str = ""
    expected: int = 0
    legs: dict[Rank, _Leg] = field(default_factory=dict)


def _legs(out: _Outgoing) -> LegReport:
    return tuple((str(rank), leg.status) for rank, leg in out.legs.items())


class PrefillSender(Agent):
    def __init__(
        self,
        mem: UnifiedMemory,
        engine: str,
        bootstrap: str,
        transport: Transport,
        *,
        chunk_bytes: int = 64 << 20,
        **options: Unpack[AgentOptions],
    ) -> None:
        """``chunk_bytes``: the most bytes of one leg in flight at a time; the rest: ``Agent``."""
        super().__init__(mem, engine, bootstrap, transport, **options)
        self.chunk_bytes = chunk_bytes
        self._peers: dict[Rank, _DecodePeer] = {}
        self._out: dict[str, _Outgoing] = {}
        self._finished: dict[str, tuple[float, str]] = {}  # request id -> (when, how it ended)
        self._sent: set[str] = set()  # handed over, not yet collected by ``poll``; owner thread only
        self._stage: SourceStaging | None = None  # the worker thread's, once built
        try:
            if transport.pays_per_op:
                self._stage = SourceStaging(transport, mem.arena.buffer)
            self._start()
            register = Register(
                self.rank, self.endpoint, transport.name, transport.session, self.buffers, self.epoch, this_process()
            )
            reply = bootstrap_call(self.bootstrap, register, self.seal)
        except BaseException:
            self.close()
            raise
        if not (isinstance(reply, RegisterAck) and reply.ok):
            self.close()
            raise TransferError(f"bootstrap {self.bootstrap} refused {self.rank}: {reply}")

    # --- owner API -------------------------------------------------------------------

    def send(self, request_id: str, pages: np.ndarray, slot: int | None, seq_len: int, pinned: MoveGate) -> None:
        """Hand over a finished request: its virtual pages (in order) and state slot.

        ``pinned`` is the owner's pin of them (e.g. ``KVManager.pin``); it must hold them until
        ``poll`` returns the request's final status, and the owner unpins after that.
        """
        if request_id in self._sent:
            raise ValueError(f"request {request_id!r} was already sent")
        pages = np.asarray(pages, dtype=np.int64)
        need = num_pages(seq_len, self.mem.page_size)
        if seq_len < 1 or pages.size < need:
            raise PlanError(
                f"send {request_id!r}: {pages.size} pages cannot hold {seq_len} tokens "
                f"({need} pages of {self.mem.page_size})"
            )
        if (slot is None) != (not self.mem.slot_pools):
            raise PlanError(
                f"send {request_id!r}: this shard {'has' if self.mem.slot_pools else 'has no'} "
                f"recurrent state, so pass {'a' if self.mem.slot_pools else 'no'} state slot"
            )
        pages = pages[:need]
        slots = [] if slot is None else [slot]
        held = pinned.status is GateStatus.PINNING
        if not held or not (np.isin(pages, pinned.pages).all() and np.isin(slots, pinned.slots).all()):
            raise PlanError(f"send {request_id!r}: the owner's pin does not hold every page and slot sent")
        self._sent.add(request_id)
        cells = memory_cells(self.mem, pages, slot)
        self.call_soon(partial(self._on_input, request_id, cells, seq_len))

    def poll(self) -> list[StatusReport]:
        """Finished requests since the last call: no leg reads their pages and slots any more, so
        their owner may unpin them."""
        reports = []
        while not self.events.empty():
            _, request_id, report = self.events.get()
            self._sent.discard(request_id)
            assert isinstance(report, StatusReport)
            reports.append(report)
        return reports

    def abort(self, request_id: str, reason: str = "aborted by prefill") -> None:
        self.call_soon(partial(self._abort, request_id, reason))

    # --- I/O thread ------------------------------------------------------------------

    def on_message(self, msg: Message, epoch: int) -> None:
        if isinstance(msg, Hello):
            self._on_hello(msg, epoch)
            return
        if not isinstance(msg, TransferRequest | Abort | Heartbeat):
            self.reject(f"a prefill rank does not take {type(msg).__name__} messages")
            return
        peer = self._peers.get(msg.rank)
        if peer is None or peer.epoch != epoch:
            said = "never said hello" if peer is None else f"said hello from epoch {peer.epoch}"
            self.reject(f"{type(msg).__name__} from {msg.rank} epoch {epoch}, which {said}")
            return
        if isinstance(msg, TransferRequest):
            self._on_request(peer, msg)
        elif isinstance(msg, Abort):
            self._on_abort(msg)
        else:
            peer.last_seen = time.monotonic()

    def _on_hello(self, msg: Hello, epoch: int) -> None:
        check_endpoint(msg.endpoint)  # refused outright: no status is ever sent to such an endpoint
        old = self._peers.get(msg.rank)
        if old is not None:
            same = (old.endpoint, old.session, old.buffers) == (msg.endpoint, msg.session, msg.buffers)
            if epoch < old.epoch or (epoch == old.epoch and not same):
                self.reject(
                    f"hello from {msg.rank} epoch {epoch} refused: that rank said hello from epoch {old.epoch} "
                    f"at {old.endpoint}; only a newer epoch (a restarted rank) may replace it"
                )
                return
            if epoch == old.epoch:  # the same hello again (a reconnect): nothing changes
                old.last_seen = time.monotonic()
                return
            restarted = f"decode {msg.rank} restarted (epoch {old.epoch} -> {epoch})"
            for out in list(self._out.values()):
                if msg.rank in out.legs:
                    self._fail(out, restarted)
        route, error = self._route(msg)
        if error:
            log.warning("%s: cannot serve decode %s: %s", self.rank, msg.rank, error)
        else:  # a decode rank says hello when its first request is reserved: warm up while prefill computes
            self.submit(partial(self.transport.warm, msg.session))
        self._peers[msg.rank] = _DecodePeer(
            msg.rank, msg.endpoint, msg.session, msg.buffers, route, error, time.monotonic(), epoch
        )

    def _route(self, msg: Hello) -> tuple[Route | None, str]:
        """How to serve the decode rank of ``msg``, or why it cannot be served."""
        if msg.transport != self.transport.name:
            return None, (
                f"transport mismatch: decode {msg.rank} uses {msg.transport!r}, prefill "
                f"{self.rank} uses {self.transport.name!r}; start both with the same transport"
            )
        if (msg.rank.pp, msg.rank.tp) != (msg.buffers.pp_rank, msg.buffers.tp_rank):
            return None, f"hello from {msg.rank} carries the layout of another rank"
        try:
            self.transport.check_session(msg.session)
            return Route(self.buffers, msg.buffers, pair_entries(self.buffers, msg.buffers)), ""
        except (LayoutMismatch, BadLayout) as exc:
            return None, str(exc)
        except TransferError as exc:
            return None, f"hello from {msg.rank} refused: {exc}"

    def _new(self, request_id: str) -> _Outgoing:
        out = _Outgoing(RequestStatus(request_id), time.monotonic() + self.timeout_s)
        self._out[request_id] = out
        return out

    def _on_request(self, peer: _DecodePeer, msg: TransferRequest) -> None:
        rid = msg.request_id
        peer.last_seen = time.monotonic()
        out = self._out.get(rid)
        if out is None:
            if rid in self._finished:
                ended = f"request already finished here ({self._finished[rid][1]})"
                self._send_status(peer, rid, msg.nonce, LegStatus.FAILED, ended)
                self.reject(f"late request {rid!r} from {msg.rank}: {ended}")
                return
            out = self._new(rid)
        if msg.rank in out.legs:
            self.reject(f"duplicate request {rid!r} from {msg.rank}")
            return
        if out.engine and out.engine != msg.rank.engine:
            self._send_status(peer, rid, msg.nonce, LegStatus.FAILED, f"bound to decode engine {out.engine!r}")
            return
        cells = msg.dst_cells
        deadline = time.monotonic() + max(0.0, msg.ttl_s)
        leg = _Leg(peer, msg.nonce, msg.seq_len, cells, msg.checksum, deadline)
        out.legs[msg.rank] = leg
        out.engine = msg.rank.engine
        out.expected = peer.buffers.pp_size * peer.buffers.tp_size
        if out.status.terminal:
            self._finish_leg(out, leg, f"request already failed here: {out.status.reason}")
            return
        if peer.error:
            self._finish_leg(out, leg, peer.error)
            return
        assert peer.route is not None
        try:  # the destination side of the plan now, while the prefill's forward still runs
            leg.dest = peer.route.prepare(leg.seq_len, cells)
        except TransferError as exc:
            self._finish_leg(out, leg, str(exc))
            return
        except Exception as exc:  # a bug: fail the leg, never report success
            log.exception("%s: preparing the leg of %s failed", self.rank, rid)
            self._finish_leg(out, leg, f"internal error: {exc!r}")
            return
        out.status.advance(Phase.WAITING_FOR_INPUT)
        self._start_legs(out)

    def _on_input(self, request_id: str, cells: dict[str, np.ndarray], seq_len: int) -> None:
        if request_id in self._finished:
            status = RequestStatus(request_id)
            status.fail("the request had already finished (timed out or aborted) before send")
            self.events.put((EventKind.DONE, request_id, status.report()))
            return
        out = self._out.get(request_id) or self._new(request_id)
        out.cells, out.seq_len = cells, seq_len
        if out.legs:
            out.status.advance(Phase.WAITING_FOR_INPUT)
        self._start_legs(out)

    def _start_legs(self, out: _Outgoing) -> None:
        if out.cells is not None and not out.status.terminal:
            for leg in out.legs.values():
                if leg.status is not LegStatus.ASKED:
                    continue
                if leg.seq_len != out.seq_len:
                    self._finish_leg(
                        out,
                        leg,
                        f"seq_len mismatch: prefill {self.rank} has {out.seq_len} tokens, decode "
                        f"{leg.peer.rank} asked for {leg.seq_len}",
                    )
                    continue
                leg.enter(LegStatus.TRANSFERRING)
                out.status.advance(Phase.TRANSFERRING)
                self._send_status(leg.peer, out.status.request_id, leg.nonce, LegStatus.TRANSFERRING)
                self.submit(partial(self._run_leg, out, leg))
        self._publish(out)

    def _run_leg(self, out: _Outgoing, leg: _Leg) -> None:
        """Worker thread: plan and write one decode rank's share of the request."""
        assert out.cells is not None and leg.peer.route is not None and leg.dest is not None
        try:  # the destination side was prepared when the request arrived: only the source side is left
            plan = leg.peer.route.complete(leg.dest, out.cells)
            stop = partial(self._should_stop, leg)
            ops = write_plan(self.transport, leg.peer.session, plan, self.chunk_bytes, stop, self._stage)
            src, _, length = plan.ops()
            crc = checksum_addresses(self.mem.arena.buffer, src, length) if leg.checksum else None
            done = partial(self._leg_done, out, leg, "", ops, plan.nbytes, crc)
        except TransferError as exc:
            done = partial(self._leg_done, out, leg, str(exc), 0, 0, None)
        except Exception as exc:  # a bug: fail the leg, never report success
            log.exception("%s: leg of %s failed", self.rank, out.status.request_id)
            done = partial(self._leg_done, out, leg, f"internal error: {exc!r}", 0, 0, None)
        self.call_soon(done)

    @staticmethod
    def _should_stop(leg: _Leg) -> str:
        if leg.stop_reason:
            return leg.stop_reason
        return "the decode's deadline passed" if time.monotonic() > leg.deadline else ""

    def _leg_done(self, out: _Outgoing, leg: _Leg, error: str, ops: int, nbytes: int, crc: int | None) -> None:
        rid = out.status.request_id
        if error:
            leg.enter(LegStatus.FAILED)
            self._send_status(leg.peer, rid, leg.nonce, LegStatus.FAILED, error)
            self._fail(out, f"to decode {leg.peer.rank}: {error}")
        else:
            leg.enter(LegStatus.SUCCESS)
            out.status.ops += ops
            out.status.nbytes += nbytes
            self._send_status(leg.peer, rid, leg.nonce, LegStatus.SUCCESS, "", ops, nbytes, crc)
            if len(out.legs) == out.expected and all(g.status is LegStatus.SUCCESS for g in out.legs.values()):
                out.status.advance(Phase.SUCCESS)
        self._finish(out)

    def _finish_leg(self, out: _Outgoing, leg: _Leg, error: str) -> None:
        """End a leg that never ran, telling its decode rank why."""
        leg.enter(LegStatus.FAILED)
        self._send_status(leg.peer, out.status.request_id, leg.nonce, LegStatus.FAILED, error)
        self._fail(out, f"to decode {leg.peer.rank}: {error}")
        self._finish(out)

    def _fail(self, out: _Outgoing, reason: str) -> None:
        if not out.status.fail(reason):
            return
        for leg in out.legs.values():
            if leg.status is LegStatus.TRANSFERRING:
                leg.stop_reason = reason
            elif leg.status is LegStatus.ASKED:
                leg.enter(LegStatus.FAILED)
                self._send_status(leg.peer, out.status.request_id, leg.nonce, LegStatus.FAILED, reason)
        self._finish(out)

    def _finish(self, out: _Outgoing) -> None:
        """Hand a terminal request back to the owner once no leg can still read its pages."""
        self._publish(out)
        rid = out.status.request_id
        if not out.status.terminal or any(g.status is LegStatus.TRANSFERRING for g in out.legs.values()):
            return
        if self._out.pop(rid, None) is not None:
            ended = out.status.reason or out.status.phase.label
            self._finished[rid] = (time.monotonic(), ended)
            self.events.put((EventKind.DONE, rid, out.status.report(_legs(out))))

    def _abort(self, request_id: str, reason: str) -> None:
        out = self._out.get(request_id)
        if out is not None:
            self._fail(out, reason)

    def _on_abort(self, msg: Abort) -> None:
        out = self._out.get(msg.request_id)
        leg = out.legs.get(msg.rank) if out is not None else None
        if out is None or leg is None or leg.nonce != msg.nonce:
            self.reject(f"abort of {msg.request_id!r} from {msg.rank}: unknown, late or forged")
            return
        reason = f"aborted by decode {msg.rank}: {msg.reason}"
        if leg.status is LegStatus.ASKED:
            self._finish_leg(out, leg, reason)
        else:
            self._fail(out, reason)

    def _send_status(
        self,
        peer: _DecodePeer,
        request_id: str,
        nonce: int,
        status: LegStatus,
        reason: str = "",
        ops: int = 0,
        nbytes: int = 0,
        checksum: int | None = None,
    ) -> None:
        self.post(peer.endpoint, Status(request_id, nonce, self.rank, status, reason, ops, nbytes, checksum))

    def _publish(self, out: _Outgoing) -> None:
        self._reports.publish(out.status, _legs(out))

    def tick(self, now: float) -> None:
        for out in list(self._out.values()):
            if not out.status.terminal and now > out.deadline:
                waiting = (
                    f"{len(out.legs)} of {out.expected or '?'} decode ranks asked"
                    if out.cells is not None
                    else "the KV was never handed over (send)"
                )
                self._fail(
                    out,
                    f"timed out after {self.timeout_s:.1f} s in phase {out.status.phase.label} ({waiting})",
                )
            for leg in list(out.legs.values()):
                if leg.status is LegStatus.ASKED and now > leg.deadline + WAITING_GRACE_S:
                    self._finish_leg(out, leg, "the decode's deadline passed before the KV was ready")
        active = {leg.peer.rank for out in self._out.values() for leg in out.legs.values() if not leg.status.terminal}
        for rank in active:
            peer = self._peers[rank]
            if now - peer.last_seen > self.peer_timeout_s:
                reason = f"decode {rank} silent for {now - peer.last_seen:.1f} s (heartbeat timeout)"
                for out in list(self._out.values()):
                    if rank in out.legs:
                        self._fail(out, reason)
        if now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            for rank in active:
                self.post(self._peers[rank].endpoint, Heartbeat(self.rank, self.endpoint))
        for rid, (at, _) in list(self._finished.items()):
            if now - at > FINISHED_KEEP_S:
                del self._finished[rid]
