"""Faults: wrong layouts, bad indices, forged / duplicate / late / malformed messages,
timeouts, lying transports, a failing Mooncake engine. Every request ends Failed with a
clear reason, decode pages are freed (``verify()`` passes) and nothing corrupted is ever
reported as Success. Prefill ranks run in this process (real agents, real transports)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import zmq

from hybridkv.memory import InvalidIds, MoveGate, PinnedError, UnifiedMemory
from hybridkv.spec import RECURRENT_POOL, IdSpace, Parallel, ShardSpec, get_preset
from hybridkv.testing.harness import MEMORY, MODEL, decode_rank, variant
from hybridkv.testing.pattern import expected_arena, fill, mismatch
from hybridkv.testing.reservations import Reservations, send
from hybridkv.transfer import (
    LegStatus,
    Phase,
    PlanError,
    PrefillSender,
    RequestStatus,
    TransportError,
    buffer_set_from_memory,
    build_plan,
    make_transport,
    pair_entries,
    shared_memory,
)
from hybridkv.transfer.auth import Gate
from hybridkv.transfer.bootstrap import bootstrap_call
from hybridkv.transfer.messages import (
    Abort,
    Hello,
    Lookup,
    LookupReply,
    Rank,
    RegisterAck,
    Status,
    TransferRequest,
)
from hybridkv.transfer.status import ReportBoard
from hybridkv.transfer.transport.drills import Delegating
from tests.transfer.waits import wait_until
from tests.transfer.wire import Wire


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


def stage_memory(pp_rank: int, model: str = MODEL) -> UnifiedMemory:
    return UnifiedMemory.create(ShardSpec(get_preset(model), Parallel(1, 2), pp_rank, 0), "1MiB", **MEMORY)


def prefill_ranks(key, bootstrap, stack, transport="shm", stages=(0, 1), wrap=None, **kw) -> list[PrefillSender]:
    senders = []
    for k in stages:
        link = make_transport(transport)
        stack.callback(link.close)
        sender = PrefillSender(
            stage_memory(k), "pre", bootstrap.address, wrap(link) if wrap else link, heartbeat_s=0.2, key=key, **kw
        )
        stack.callback(sender.close)
        senders.append(sender)
    return senders


def hand_over(senders, rid: str, seq_len: int, seed: int) -> list[tuple[np.ndarray, int | None, MoveGate]]:
    held = []
    for s in senders:
        pages = s.mem.alloc_pages(-(-seq_len // s.mem.page_size))
        slot = int(s.mem.alloc_state(1)[0]) if s.mem.slot_pools else None
        fill(s.mem, pages, slot, seq_len, seed)
        held.append((pages, slot, send(s, rid, pages, slot, seq_len)))
    return held


def settle(res: Reservations, timeout_s: float = 5.0) -> None:
    """Poll until the decode rank holds no pages any more (failed reservations freed); then
    memory must verify."""
    assert res.settle(timeout_s) == 0
    res.receiver.mem.verify()
    assert res.receiver.mem.stats().live_pages == 0


def failed_everywhere(senders, rid: str) -> bool:
    reports = [s.status(rid) for s in senders]
    return all(r is not None and r.phase is Phase.FAILED for r in reports)


@pytest.fixture
def wire(key):
    w = Wire(key)
    yield w
    w.close()


# --- layouts and indices ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("decode_kw", "reason"),
    [
        ({"page_size": 8}, "page size mismatch"),
        ({"model": variant(MODEL, state_dim=4)}, "state slot size mismatch"),
        ({"model": variant(MODEL, head_dim=16)}, "item length mismatch"),
    ],
)
def test_wrong_layout_fails_before_any_byte_moves(key, bootstrap, stack, decode_kw, reason):
    senders = prefill_ranks(key, bootstrap, stack)
    hand_over(senders, "r", 20, seed=1)
    dec, mem = stack.enter_context(decode_rank(bootstrap.address, "shm", key=key, **decode_kw))
    res = Reservations(dec)
    res.request("r", "pre", 20)
    report = dec.wait("r", 10)
    assert report.phase is Phase.FAILED
    assert reason in report.reason and "prefill" in report.reason and "decode" in report.reason
    assert mismatch(mem, np.zeros(mem.arena.nbytes, np.uint8)) == ""  # not a byte written
    settle(res)
    assert all(s.status("r").phase is Phase.BOOTSTRAPPING for s in senders)  # never asked


def test_prefill_checks_layouts_and_indices_itself(key, bootstrap, stack, wire):
    """A decode that skips its own checks (here: a scripted one) still cannot make a prefill
    rank write outside the decode's pools or into mismatched layouts."""
    (stage1,) = prefill_ranks(key, bootstrap, stack, stages=(1,))
    dmem, shared = shared_memory(ShardSpec.whole(get_preset(MODEL)), "1MiB", **MEMORY)
    stack.callback(shared.close)
    dmem.arena.buffer.zero_()
    link = make_transport("shm", shared)
    me = Rank("fake", 0, 0)
    wire.send(stage1.endpoint, Hello(me, wire.endpoint, "shm", link.session, buffer_set_from_memory(dmem)))
    pages = dmem.alloc_pages(5)
    cells = {str(p): pool.v2p[pages].tolist() for p, pool in dmem.pools.items() if p.id_space is IdSpace.PAGE}
    cells["state"] = [int(dmem.pools[RECURRENT_POOL].v2p[dmem.alloc_state(1)[0]])]
    hand_over([stage1], "far", 20, seed=2)
    far = dict(cells, full=[10**9, *cells["full"][1:]])
    wire.send(stage1.endpoint, TransferRequest("far", 7, me, 20, far, 5.0, False))
    failed = wire.recv(Status)  # refused as the request arrives (its destination side is prepared then)
    assert failed.phase == "failed" and failed.nonce == 7
    assert "decode cell 1000000000" in failed.reason and "outside [1, " in failed.reason
    assert mismatch(dmem, np.zeros(dmem.arena.nbytes, np.uint8)) == ""

    wire.send(stage1.endpoint, TransferRequest("far", 7, me, 20, cells, 5.0, False))  # again: late
    assert "already finished" in wire.recv(Status).reason

    # a decode whose layout does not pair: every request is refused with the reason
    other = UnifiedMemory.create(ShardSpec.whole(get_preset(MODEL)), "1MiB", **dict(MEMORY, page_size=8))
    liar = Rank("other", 0, 0)
    bufs = buffer_set_from_memory(other)
    wire.send(stage1.endpoint, Hello(liar, wire.endpoint, "shm", link.session, bufs))
    hand_over([stage1], "odd", 20, seed=3)
    wire.send(stage1.endpoint, TransferRequest("odd", 8, liar, 20, cells, 5.0, False))
    assert "page size mismatch" in wire.recv(Status).reason

    # owner misuse is refused at once, with nothing pinned
    mem = stage1.mem
    with pytest.raises(InvalidIds):
        send(stage1, "dead", np.array([mem.pages.capacity - 1] * 5), int(mem.alloc_state(1)[0]), 20)
    with pytest.raises(PlanError, match="cannot hold 20 tokens"):
        send(stage1, "short", mem.alloc_pages(2), None, 20)
    with pytest.raises(PlanError, match="pass a state slot"):
        send(stage1, "noslot", mem.alloc_pages(5), None, 20)
    with pytest.raises(ValueError, match="already sent"):
        send(stage1, "far", mem.alloc_pages(5), int(mem.alloc_state(1)[0]), 20)


# --- messages ----------------------------------------------------------------------------


def test_forged_duplicate_late_and_malformed_messages_never_make_a_success(key, bootstrap, stack, wire):
    """Stage 0 is a real prefill rank; stage 1 is scripted and lies in every way it can."""
    (stage0,) = prefill_ranks(key, bootstrap, stack, stages=(0,))
    fake_mem = stage_memory(1)
    fake_bufs = buffer_set_from_memory(fake_mem)
    fake = Rank("pre", 1, 0)
    reply = bootstrap_call(bootstrap.address, wire.register(fake, buffers=fake_bufs), wire.seal(fake))
    assert isinstance(reply, RegisterAck) and reply.ok
    dec, _ = stack.enter_context(decode_rank(bootstrap.address, "shm", key=key, checksum=True))
    res = Reservations(dec)

    def requested(rid: str, seq_len: int) -> TransferRequest:
        hand_over([stage0], rid, seq_len, seed=4)
        res.request(rid, "pre", seq_len)
        msg = wire.recv(TransferRequest)
        assert msg.request_id == rid
        return msg

    def expected_bytes(msg: TransferRequest) -> int:
        pairs = pair_entries(fake_bufs, dec.buffers)
        dst = {k: np.array(v) for k, v in msg.dst_cells.items()}
        return build_plan(fake_bufs, dec.buffers, pairs, msg.seq_len, None, dst).nbytes

    # 1: malformed bytes, a wrong nonce, an impostor rank, success without transferring
    msg = requested("r1", 20)
    rejected = len(dec.rejected)
    wire.send(dec.endpoint, b"\x93garbage")
    wire.send(dec.endpoint, Status("r1", msg.nonce + 1, fake, "success", nbytes=expected_bytes(msg)))
    wire.send(dec.endpoint, Status("r1", msg.nonce, Rank("evil", 1, 0), "success"))
    wait_until(lambda: len(dec.rejected) == rejected + 3)
    # decode took the real stage's success (a bounded handshake, no sleep)...
    wait_until(lambda: dec.status("r1").leg("pre[pp0 tp0]") is LegStatus.SUCCESS)
    assert dec.status("r1").phase is Phase.TRANSFERRING  # ...but every stage must report
    assert dec.status("r1").leg("pre[pp1 tp0]") is LegStatus.ASKED
    wire.send(dec.endpoint, Status("r1", msg.nonce, fake, "success", nbytes=expected_bytes(msg)))
    report = dec.wait("r1", 5)
    assert report.phase is Phase.FAILED and "success without transferring" in report.reason

    # 2: a status no leg reports, then a wrong byte count
    msg = requested("r2", 20)
    rejected = len(dec.rejected)
    wire.send(dec.endpoint, Status("r2", msg.nonce, fake, "asked"))
    wait_until(lambda: len(dec.rejected) == rejected + 1)
    wire.send(dec.endpoint, Status("r2", msg.nonce, fake, "transferring"))
    wire.send(dec.endpoint, Status("r2", msg.nonce, fake, "success", nbytes=expected_bytes(msg) - 4))
    report = dec.wait("r2", 5)
    assert report.phase is Phase.FAILED and "decode expected" in report.reason

    # 3: the right claims but no bytes: the checksum catches it; a duplicate changes nothing
    msg = requested("r3", 20)
    wire.send(dec.endpoint, Status("r3", msg.nonce, fake, "transferring"))
    claim = Status("r3", msg.nonce, fake, "success", nbytes=expected_bytes(msg), checksum=12345)
    wire.send(dec.endpoint, claim)
    report = dec.wait("r3", 5)
    assert report.phase is Phase.FAILED and "checksum mismatch for prefill pre[pp1 tp0]" in report.reason
    rejected = len(dec.rejected)
    wire.send(dec.endpoint, claim)  # duplicate
    wire.send(dec.endpoint, Status("r1", msg.nonce, fake, "success"))  # late, for a freed request
    wait_until(lambda: len(dec.rejected) == rejected + 2)
    assert dec.status("r3").phase is Phase.FAILED and dec.status("r1").phase is Phase.FAILED

    # the real prefill rank drops a forged abort and garbage
    before = len(stage0.rejected)
    wire.send(stage0.endpoint, Abort("r3", 1, dec.rank, "forged"))
    wire.send(stage0.endpoint, b"not msgpack at all")
    wait_until(lambda: len(stage0.rejected) == before + 2)
    settle(res)  # every rank had its last word: nothing quarantined
    stage0.poll()
    stage0.mem.verify()


def test_bootstrap_refuses_bad_registrations_and_keeps_serving(key, bootstrap, wire):
    mem = stage_memory(0)
    bufs = buffer_set_from_memory(mem)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(bootstrap.address)
    for frame, says in [(key.mac(b"\xc1") + b"\xc1", "malformed"), (b"\xc1", "without a valid MAC")]:
        sock.send(frame)
        assert sock.poll(5000)
        refusal = Gate(key).open(sock.recv(), "").body
        assert isinstance(refusal, RegisterAck) and not refusal.ok and says in refusal.reason
    sock.close()
    pre0, pre1 = Rank("pre", 0, 0), Rank("pre", 1, 0)
    wrong = wire.register(pre1, endpoint="tcp://127.0.0.1:1", buffers=bufs)  # stage 0's layout
    reply = bootstrap_call(bootstrap.address, wrong, wire.seal(pre1))
    assert isinstance(reply, RegisterAck) and not reply.ok and "layout of pp 0" in reply.reason
    good = wire.register(pre0, endpoint="tcp://127.0.0.1:1", buffers=bufs)
    assert bootstrap_call(bootstrap.address, good, wire.seal(pre0)) == RegisterAck(True, "")
    reply = bootstrap_call(bootstrap.address, Lookup("pre"), wire.seal(Rank("dec", 0, 0)))
    assert isinstance(reply, LookupReply) and not reply.complete and "1 of 2 ranks" in reply.reason
    assert len(bootstrap.rejected) == 3 and bootstrap.auth_failures == 1


# --- timeouts and aborts -----------------------------------------------------------------


def test_timeouts_and_aborts_fail_with_reasons_and_free_pages(key, bootstrap, stack):
    senders = prefill_ranks(key, bootstrap, stack, timeout_s=1.0)
    dec, _ = stack.enter_context(decode_rank(bootstrap.address, "shm", key=key, timeout_s=0.5))
    res = Reservations(dec)
    # prefill never hands the KV over: decode times out, each rank acknowledges the abort
    res.request("never", "pre", 20)
    report = dec.wait("never", 5)
    assert report.phase is Phase.FAILED
    assert report.reason.startswith("timed out after 0.5 s in phase WaitingForInput")
    assert "waiting for prefill pre[pp0 tp0], pre[pp1 tp0]" in report.reason
    settle(res, 2)  # acknowledged: no quarantine wait
    wait_until(lambda: failed_everywhere(senders, "never"))
    reason = senders[0].status("never").reason  # whichever came first: the abort or the ttl
    assert "aborted by decode" in reason or "decode's deadline passed" in reason

    # prefill hands over a request no decode asks for: pinned until it times out there
    held = hand_over(senders, "orphan", 12, seed=5)
    with pytest.raises(PinnedError):
        senders[0].mem.free_pages(held[0][0])
    wait_until(lambda: failed_everywhere(senders, "orphan"))
    assert "timed out after 1.0 s in phase Bootstrapping" in senders[0].status("orphan").reason
    for s, (pages, slot, gate) in zip(senders, held, strict=True):
        assert [r.request_id for r in s.poll()] == ["never", "orphan"]
        gate.release()  # finished: the owner unpins
        s.mem.free_pages(pages)  # unpinned, so freeing works
        if slot is not None:
            s.mem.free_state([slot])
        s.mem.verify()

    # decode aborts a request in flight; its pages are pinned until then
    dec.timeout_s = 10.0
    alloc = res.request("cancel", "pre", 20)
    with pytest.raises(PinnedError):
        dec.mem.free_pages(alloc.pages)
    dec.abort("cancel", "client went away")
    report = dec.wait("cancel", 5)
    assert report.phase is Phase.FAILED and report.reason == "client went away"
    settle(res, 5)


def test_incomplete_prefill_engine_times_out_in_bootstrap(key, bootstrap, stack):
    prefill_ranks(key, bootstrap, stack, stages=(0,))
    dec, _ = stack.enter_context(decode_rank(bootstrap.address, "shm", key=key, timeout_s=0.5))
    res = Reservations(dec)
    res.request("r", "pre", 20)
    report = dec.wait("r", 5)
    assert report.phase is Phase.FAILED
    assert "phase Bootstrapping" in report.reason and "1 of 2 ranks registered" in report.reason
    settle(res, 1)


def test_report_board_keeps_live_requests_and_the_latest_finished():
    board = ReportBoard(keep=2)
    live = RequestStatus("live")
    board.publish(live)
    for i in range(5):
        done = RequestStatus(f"done{i}")
        done.fail("x")
        board.publish(done)
    assert board.get("live") is not None and board.get("done0") is None
    assert [board.get(f"done{i}") is not None for i in range(5)] == [False, False, False, True, True]


def test_leg_status_only_moves_forward():
    asked, moving, done, failed = LegStatus.ASKED, LegStatus.TRANSFERRING, LegStatus.SUCCESS, LegStatus.FAILED
    assert asked.can_enter(moving) and asked.can_enter(failed) and moving.can_enter(done) and moving.can_enter(failed)
    assert not moving.can_enter(asked) and not moving.can_enter(moving)
    assert not done.can_enter(failed) and not failed.can_enter(done) and done.terminal and failed.terminal


def test_status_only_moves_forward():
    s = RequestStatus("x")
    assert not s.advance(Phase.SUCCESS)  # never seen in flight
    assert s.advance(Phase.TRANSFERRING) and not s.advance(Phase.WAITING_FOR_INPUT)
    assert s.advance(Phase.SUCCESS) and not s.fail("late") and s.phase is Phase.SUCCESS
    t = RequestStatus("y")
    assert t.fail("boom") and not t.advance(Phase.TRANSFERRING) and not t.fail("again")
    assert (t.phase, t.reason) == (Phase.FAILED, "boom")


# --- transports that fail or lie ---------------------------------------------------------


class Lossy(Delegating):
    """A transport that reports success but drops the last op of every submit."""

    def submit(self, peer, src, dst, length, bounds=None):
        return super().submit(peer, src[:-1], dst[:-1], length[:-1], bounds)


def test_checksum_refuses_bytes_a_transport_lost(key, bootstrap, stack):
    senders = prefill_ranks(key, bootstrap, stack, wrap=Lossy)
    dec, mem = stack.enter_context(decode_rank(bootstrap.address, "shm", key=key, checksum=True))
    res = Reservations(dec)
    hand_over(senders, "r", 20, seed=6)
    res.request("r", "pre", 20)
    report = dec.wait("r", 5)
    assert report.phase is Phase.FAILED and "checksum mismatch" in report.reason
    settle(res, 2)
    # without integrity checks a lying transport goes unnoticed: that is what they are for
    hand_over(senders, "r2", 20, seed=7)
    alloc = res.request("r2", "pre", 20, checksum=False)
    assert dec.wait("r2", 5).phase is Phase.SUCCESS
    assert mismatch(mem, expected_arena(mem, [(alloc.pages, alloc.slot, 20, 7)])) != ""


def test_failed_mooncake_write_is_a_failed_request(key, bootstrap, stack):
    senders = prefill_ranks(key, bootstrap, stack, transport="mooncake")
    dec, mem = stack.enter_context(decode_rank(bootstrap.address, "mooncake", key=key))
    res = Reservations(dec)
    hand_over(senders, "ok", 20, seed=8)
    alloc = res.request("ok", "pre", 20)
    assert dec.wait("ok", 10).phase is Phase.SUCCESS
    assert mismatch(mem, expected_arena(mem, [(alloc.pages, alloc.slot, 20, 8)])) == ""
    res.free("ok")
    # the peer engine refuses a write outside what decode registered
    link = senders[0].transport
    outside = np.array([mem.arena.buffer.data_ptr() + mem.arena.nbytes])
    with pytest.raises(TransportError, match="answering probes"):
        link.write(dec.transport.session, np.array([senders[0].mem.arena.buffer.data_ptr()]), outside, np.array([64]))
    dec.transport.close()  # decode's engine goes away: the prefill's writes must fail
    hand_over(senders, "gone", 20, seed=9)
    res.request("gone", "pre", 20)
    report = dec.wait("gone", 20)
    assert report.phase is Phase.FAILED and "mooncake batch write" in report.reason
    settle(res, 5)
