"""DecodeReceiver: a decode rank asks a prefill engine for a request's KV and state.

Protocol (this side): ``request`` pins the pages and state slot its owner reserved
(``incoming.Allocation``: the receiver never allocates or frees); the I/O thread looks the
prefill engine up at the bootstrap, checks every pairing (decode-side, before anything is
sent), says ``Hello`` to each prefill rank once, then sends a ``TransferRequest`` to *every*
prefill rank. Each rank answers ``transferring`` and then ``success`` (ops, bytes, optional
checksum) or ``failed``.

Invariants:
- Success only when every prefill rank (every PP stage, every TP rank) reported success,
  each with exactly the bytes the decode-side plan expects, and, when integrity is on,
  each checksum matches the bytes that landed. Anything else is Failed with a reason.
- Status messages whose request, nonce or sender do not match are dropped (``rejected``); a
  duplicate success is not counted twice; a late message never changes a finished request.
- Statuses and heartbeats of a prefill rank count only from the epoch it registered
  with (the bootstrap's authenticated lookup): a frame from another incarnation, or a
  forged one (no valid MAC), never keeps a request alive or moves it.
- A failed request's pages stay pinned and allocated (quarantined) until every contacted
  prefill rank has acknowledged that it stopped writing, or its process is proven gone
  (same host: pid + start time in ``/proc``, ``liveness.gone``). Never on a timer alone: a
  writer stopped (SIGSTOP) for any time may wake up and write. Past ``quarantine_s`` a
  quarantine is logged once and counted as ``stuck`` in ``stats()``; its pages stay reserved.
  Then the owner's ``poll`` unpins them and ``take_releasable`` hands them back to be freed
  through the owner's one free path.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from functools import partial
from typing import Unpack

import zmq

from hybridkv.memory import MoveGate, UnifiedMemory
from hybridkv.transfer.agent import Agent, AgentOptions, EventKind, log
from hybridkv.transfer.auth import AuthError
from hybridkv.transfer.bootstrap import BOOTSTRAP_ADDRESSEE, BOOTSTRAP_RANK, reply_prefix
from hybridkv.transfer.checksum import checksum_addresses
from hybridkv.transfer.errors import TransferError
from hybridkv.transfer.incoming import (
    Allocation,
    Incoming,
    Leg,
    Quarantine,
    ReceiverStats,
    Source,
    legs_report,
)
from hybridkv.transfer.messages import (
    Abort,
    Heartbeat,
    Hello,
    Lookup,
    LookupReply,
    Message,
    Rank,
    Status,
    TransferRequest,
)
from hybridkv.transfer.pairing import check_coverage, check_prefill_group, pair_entries
from hybridkv.transfer.plan import Route, memory_cells, num_pages
from hybridkv.transfer.status import LegStatus, Phase, RequestStatus, StatusReport
from hybridkv.transfer.transport import Transport

LOOKUP_RETRY_S = 0.1


class DecodeReceiver(Agent):
    def __init__(
        self,
        mem: UnifiedMemory,
        engine: str,
        bootstrap: str,
        transport: Transport,
        *,
        quarantine_s: float = 30.0,
        checksum: bool = False,
        **options: Unpack[AgentOptions],
    ) -> None:
        """``quarantine_s``: how long a failed request may wait for its writers to stop
        before it is reported stuck (its pages stay reserved); ``checksum``: whether requests
        check the bytes that landed unless ``request`` says otherwise; the rest: ``Agent``."""
        super().__init__(mem, engine, bootstrap, transport, **options)
        self.quarantine_s = quarantine_s
        self.checksum = checksum
        self._hello = Hello(self.rank, self.endpoint, transport.name, transport.session, self.buffers)
        self._engines: dict[str, dict[Rank, Source]] = {}
        self._waiting: dict[str, list[Incoming]] = {}
        self._lookup_sent: dict[str, float] = {}
        self._lookup_reason: dict[str, str] = {}
        self._in: dict[str, Incoming] = {}
        self._held: dict[str, MoveGate] = {}  # the receiver's pin of each request's pages; owner thread only
        self._quarantine = Quarantine()
        self._releasable: list[str] = []  # failed requests out of quarantine, unpinned; owner thread only
        self._lookups = self._ctx.socket(zmq.DEALER)  # to the bootstrap: lookups out, replies in
        self._lookups.linger = 0
        self._lookups.connect(self.bootstrap)
        self._poller.register(self._lookups, zmq.POLLIN)
        self._start()

    # --- owner API -------------------------------------------------------------------

    def request(
        self, request_id: str, prefill_engine: str, seq_len: int, reserved: Allocation, checksum: bool | None = None
    ) -> None:
        """Ask for the KV (and state) of ``seq_len`` tokens, written into ``reserved``: the pages and
        slot the owner reserved for it (pinned here until the request ends).

        Raises (nothing pinned) when the id is in use or ``reserved`` does not fit ``seq_len``.
        Follow the request with ``poll``/``wait``; on Success the pages are unpinned and the owner's
        to read. On failure ``take_releasable`` names the request once no writer can touch its pages
        any more: then the owner frees them.
        """
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already in flight on this decode rank")
        if seq_len < 1:
            raise ValueError(f"request {request_id!r}: seq_len must be >= 1, got {seq_len}")
        need = num_pages(seq_len, self.mem.page_size)
        if reserved.pages.size != need or (reserved.slot is None) != (not self.mem.slot_pools):
            raise ValueError(
                f"request {request_id!r}: {seq_len} tokens need {need} pages"
                f"{' and a state slot' if self.mem.slot_pools else ''}; the reservation holds "
                f"{reserved.pages.size} pages and slot {reserved.slot}"
            )
        slots = None if reserved.slot is None else [reserved.slot]
        self._held[request_id] = self.mem.pin(pages=reserved.pages, slots=slots)
        self._reports.publish(RequestStatus(request_id))  # no stale report of an earlier use of the id
        cells = {n: c.tolist() for n, c in memory_cells(self.mem, reserved.pages, reserved.slot).items()}
        use_crc = self.checksum if checksum is None else checksum
        self.call_soon(partial(self._start_request, request_id, prefill_engine, seq_len, cells, use_crc))

    def take_releasable(self) -> list[str]:
        """Requests that failed and are out of quarantine (no writer can touch their pages any
        more) since the last call: the owner frees their reservations now."""
        out, self._releasable = self._releasable, []
        return out

    def poll(self) -> list[StatusReport]:
        """Requests that finished since the last call. Unpins the pages of successful requests, and
        those of failed ones once they are out of quarantine (then named by ``take_releasable``)."""
        reports = []
        while not self.events.empty():
            kind, request_id, payload = self.events.get()
            if kind is EventKind.DONE:
                assert isinstance(payload, StatusReport)
                reports.append(payload)
                continue
            self._held.pop(request_id).release()
            if kind is EventKind.RELEASE:
                self._releasable.append(request_id)
        return reports

    def wait(self, request_id: str, timeout_s: float) -> StatusReport:
        """Poll until ``request_id`` is finished; raises TimeoutError after ``timeout_s``.

        On return the request's pages are unpinned (Success) or on their way back to the owner
        (Failed: after quarantine, a later ``poll`` unpins them for ``take_releasable``).
        """
        end = time.monotonic() + timeout_s
        while True:
            report = self.status(request_id)
            self.poll()  # events are queued before a terminal status is published
            if report is not None and report.phase.terminal:
                return report
            if time.monotonic() > end:
                raise TimeoutError(f"request {request_id!r} not finished after {timeout_s} s")
            time.sleep(0.0005)

    @property
    def held(self) -> int:
        """Requests whose pages this receiver still holds (in flight or quarantined)."""
        return len(self._held)

    def stats(self) -> ReceiverStats:
        quarantined, pages, stuck = self._quarantine.counts()
        return ReceiverStats(len(self._held), quarantined, pages, stuck, self.auth_failures, len(self.rejected))

    def abort(self, request_id: str, reason: str = "aborted by decode") -> None:
        self.call_soon(partial(self._abort, request_id, reason))

    # --- I/O thread: request start ----------------------------------------------------

    def _start_request(self, rid: str, engine: str, seq_len: int, cells: dict[str, list[int]], checksum: bool) -> None:
        inc = Incoming(
            RequestStatus(rid),
            engine,
            seq_len,
            cells,
            checksum,
            secrets.randbits(63),
            time.monotonic() + self.timeout_s,
        )
        self._in[rid] = inc
        self._publish(inc)
        if engine in self._engines:
            self._dispatch(inc)
        else:
            self._waiting.setdefault(engine, []).append(inc)
            self._lookup(engine)

    def _lookup(self, engine: str) -> None:
        self._lookup_sent[engine] = time.monotonic()
        with contextlib.suppress(zmq.Again):  # retried from tick
            self._lookups.send(self.seal.seal(BOOTSTRAP_ADDRESSEE, Lookup(engine)), zmq.NOBLOCK)

    def on_socket(self, sock: zmq.Socket) -> None:
        while sock.poll(0):
            self._guard("bootstrap reply", partial(self._on_bootstrap, sock.recv()))

    def _on_bootstrap(self, data: bytes) -> None:
        prefix = reply_prefix(self.seal)
        env = self.gate.open(data, lambda to: to.startswith(prefix))
        if env.sender != BOOTSTRAP_RANK:
            raise AuthError(f"a bootstrap reply sent by {env.sender}")
        self._on_lookup(env.body)

    def _on_lookup(self, reply: Message) -> None:
        if not isinstance(reply, LookupReply):
            self.reject(f"bootstrap answered {type(reply).__name__}: {reply}")
            return
        self._lookup_reason[reply.engine] = reply.reason
        waiting = self._waiting.get(reply.engine, [])
        if not reply.complete or reply.engine in self._engines or not waiting:
            return  # retried from tick while requests wait, until their deadline
        del self._waiting[reply.engine]
        try:
            sources = self._connect(reply)
        except TransferError as exc:
            for inc in waiting:
                self._fail(inc, str(exc))
            return
        self._engines[reply.engine] = sources
        for inc in waiting:
            if not inc.status.terminal:
                self._dispatch(inc)

    def _connect(self, reply: LookupReply) -> dict[Rank, Source]:
        """Check every prefill rank against this rank's layout, then say hello."""
        prefills = [r.buffers for r in reply.ranks]
        check_prefill_group(prefills)
        check_coverage(self.buffers, prefills)
        sources = {}
        for reg in reply.ranks:
            if reg.transport != self.transport.name:
                raise TransferError(
                    f"transport mismatch: prefill {reg.rank} uses {reg.transport!r}, decode "
                    f"{self.rank} uses {self.transport.name!r}; start both with the same transport"
                )
            pairs = pair_entries(reg.buffers, self.buffers)
            sources[reg.rank] = Source(reg, Route(reg.buffers, self.buffers, pairs))
        now = time.monotonic()
        for source in sources.values():
            source.last_seen = now
            self.post(source.reg.endpoint, self._hello)
        return sources

    def _dispatch(self, inc: Incoming) -> None:
        """Plan this rank's side of every leg, then ask every prefill rank."""
        now = time.monotonic()
        sources = self._engines[inc.engine]
        try:
            for rank, source in sources.items():
                plan = source.route.plan(inc.seq_len, None, inc.dst_cells)
                inc.legs[rank] = Leg(source, plan, now)
        except TransferError as exc:
            inc.legs.clear()
            self._fail(inc, str(exc))
            return
        request = TransferRequest(
            inc.status.request_id,
            inc.nonce,
            self.rank,
            inc.seq_len,
            inc.dst_cells,
            max(0.0, inc.deadline - now),
            inc.checksum,
        )
        for leg in inc.legs.values():
            self.post(leg.source.reg.endpoint, request)
        inc.status.advance(Phase.WAITING_FOR_INPUT)
        self._publish(inc)

    # --- I/O thread: progress ---------------------------------------------------------

    def on_message(self, msg: Message, epoch: int) -> None:
        if isinstance(msg, Status):
            self._on_status(msg, epoch)
        elif isinstance(msg, Heartbeat):
            source = self._engines.get(msg.rank.engine, {}).get(msg.rank)
            if source is not None and source.reg.epoch != epoch:
                self.reject(f"heartbeat from {msg.rank} epoch {epoch}: not a registered source of that epoch")
            elif source is not None:
                source.last_seen = time.monotonic()
        else:
            self.reject(f"a decode rank does not take {type(msg).__name__} messages")

    def _on_status(self, msg: Status, epoch: int) -> None:
        inc = self._in.get(msg.request_id)
        leg = inc.legs.get(msg.rank) if inc is not None else None
        if leg is not None and leg.source.reg.epoch != epoch:
            self.reject(
                f"status for {msg.request_id!r} from {msg.rank} epoch {epoch}; it registered with epoch "
                f"{leg.source.reg.epoch}"
            )
            return
        if inc is None or leg is None or msg.nonce != inc.nonce:
            self.reject(
                f"status {msg.phase.value!r} for {msg.request_id!r} from {msg.rank}: unknown request, "
                "not one of its senders, or wrong nonce (late or forged)"
            )
            return
        leg.source.last_seen = time.monotonic()
        if msg.phase is LegStatus.ASKED or not leg.status.can_enter(msg.phase):
            self.reject(
                f"{msg.phase.value!r} for {msg.request_id!r} from {msg.rank}: duplicate or out of order "
                f"(the leg is {leg.status.value!r})"
            )
            return
        if msg.phase is LegStatus.TRANSFERRING:
            leg.status = LegStatus.TRANSFERRING
            inc.status.advance(Phase.TRANSFERRING)
        elif msg.phase is LegStatus.FAILED:
            leg.status = LegStatus.FAILED
            self._fail(inc, f"prefill {msg.rank}: {msg.reason}")
        elif msg.nbytes != leg.plan.nbytes:
            leg.status = LegStatus.FAILED
            self._fail(
                inc,
                f"prefill {msg.rank} reported {msg.nbytes} B written, decode expected "
                f"{leg.plan.nbytes} B: layouts disagree",
            )
        elif leg.status is not LegStatus.TRANSFERRING:
            leg.status = LegStatus.FAILED
            self._fail(inc, f"prefill {msg.rank} reported success without transferring")
        else:
            leg.status, leg.checksum = LegStatus.SUCCESS, msg.checksum
            self._maybe_succeed(inc)
        self._release_if_quiet(inc)
        self._publish(inc)

    def _maybe_succeed(self, inc: Incoming) -> None:
        if inc.status.terminal or any(g.status is not LegStatus.SUCCESS for g in inc.legs.values()):
            return
        if not inc.checksum:
            self._succeed(inc)
        elif not inc.verifying:
            inc.verifying = True
            self.submit(partial(self._verify, inc))

    def _verify(self, inc: Incoming) -> None:
        """Worker thread: checksum the bytes that landed, leg by leg."""
        error = ""
        for rank, leg in inc.legs.items():
            _, dst, length = leg.plan.ops()
            got = checksum_addresses(self.mem.arena.buffer, dst, length)
            if leg.checksum != got:
                error = (
                    f"checksum mismatch for prefill {rank}: it sent {leg.checksum}, the "
                    f"{leg.plan.nbytes} B that landed give {got}"
                )
                break
        self.call_soon(partial(self._verified, inc, error))

    def _verified(self, inc: Incoming, error: str) -> None:
        if error:
            self._fail(inc, error)
        else:
            self._succeed(inc)

    def _succeed(self, inc: Incoming) -> None:
        if inc.status.advance(Phase.SUCCESS):
            inc.status.nbytes = sum(g.plan.nbytes for g in inc.legs.values())
            inc.status.ops = sum(g.plan.num_ops for g in inc.legs.values())
            rid = inc.status.request_id
            self.events.put((EventKind.KEEP, rid, None))
            self.events.put((EventKind.DONE, rid, inc.status.report(legs_report(inc))))
            self._publish(inc)
            del self._in[rid]

    def _fail(self, inc: Incoming, reason: str) -> None:
        if not inc.status.fail(reason):
            return
        rid = inc.status.request_id
        log.warning("%s: request %s failed: %s", self.rank, rid, reason)
        abort = Abort(rid, inc.nonce, self.rank, reason)
        for leg in inc.legs.values():
            if not leg.status.terminal:
                self.post(leg.source.reg.endpoint, abort)
        inc.quarantine_until = time.monotonic() + self.quarantine_s
        self._quarantine.add(rid, num_pages(inc.seq_len, self.mem.page_size))
        self.events.put((EventKind.DONE, rid, inc.status.report(legs_report(inc))))
        self._release_if_quiet(inc)
        self._publish(inc)

    def _release_if_quiet(self, inc: Incoming, now: float | None = None) -> None:
        """Release a failed request's pages to the owner once no prefill rank can still write into
        them: each acknowledged (its leg ended) or its process is proven gone."""
        now = time.monotonic() if now is None else now
        if self._quarantine.over(inc, now, self.quarantine_s, str(self.rank)):
            self._in.pop(inc.status.request_id, None)
            self.events.put((EventKind.RELEASE, inc.status.request_id, None))

    def _abort(self, request_id: str, reason: str) -> None:
        inc = self._in.get(request_id)
        if inc is not None:
            self._fail(inc, reason)

    def _publish(self, inc: Incoming) -> None:
        self._reports.publish(inc.status, legs_report(inc))

    def tick(self, now: float) -> None:
        for engine, waiting in list(self._waiting.items()):
            waiting[:] = [inc for inc in waiting if not inc.status.terminal]
            if not waiting:
                del self._waiting[engine]
            elif now - self._lookup_sent.get(engine, 0.0) > LOOKUP_RETRY_S:
                self._lookup(engine)
        silent: dict[Rank, float] = {}
        for inc in list(self._in.values()):
            if inc.status.terminal:
                self._release_if_quiet(inc, now)
                continue
            if now > inc.deadline:
                pending = [str(r) for r, g in inc.legs.items() if g.status is not LegStatus.SUCCESS]
                if pending:
                    detail = f"; waiting for prefill {', '.join(pending)}"
                else:
                    detail = f"; bootstrap: {self._lookup_reason.get(inc.engine, 'no answer')}"
                self._fail(
                    inc,
                    f"timed out after {self.timeout_s:.1f} s in phase {inc.status.phase.label}" + detail,
                )
                continue
            for rank, leg in inc.legs.items():
                quiet_for = now - max(leg.source.last_seen, leg.since)
                if not leg.status.terminal and quiet_for > self.peer_timeout_s:
                    silent[rank] = quiet_for
        for rank, quiet_for in silent.items():
            reason = f"prefill {rank} silent for {quiet_for:.1f} s (heartbeat timeout)"
            for inc in list(self._in.values()):
                if rank in inc.legs:
                    self._fail(inc, reason)
            self._engines.pop(rank.engine, None)  # look it up afresh: it may have restarted
        if now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            ranks = {
                leg.source.reg.endpoint
                for inc in self._in.values()
                if not inc.status.terminal
                for leg in inc.legs.values()
            }
            for endpoint in ranks:
                self.post(endpoint, Heartbeat(self.rank, self.endpoint))

    def _close_sockets(self) -> None:
        super()._close_sockets()
        self._lookups.close(linger=0)
