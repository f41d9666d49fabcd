"""An attacker on the control plane, with and without the cluster key; a writer that outlives
its request. Each test here failed on main before the control plane was authenticated
(issue 9, transfer items 1-5): forged ``Hello`` replacing a known decode rank (shm and
Mooncake), a ``Hello`` naming any file as the shm session, forged heartbeats keeping a
dead peer's requests alive, a stopped writer outliving the quarantine, a destination
naming an unknown pool. Honest requests stay byte-exact throughout."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time

import msgspec
import numpy as np
import pytest

from hybridkv.spec import ShardSpec, get_preset
from hybridkv.testing.harness import MEMORY, MODEL, StageProcess, decode_rank, stage_config
from hybridkv.testing.pattern import expected_arena, fill, mismatch
from hybridkv.testing.reservations import Reservations
from hybridkv.transfer import (
    BootstrapServer,
    ClusterKey,
    Phase,
    PlanError,
    PrefillSender,
    TransferError,
    TransportError,
    buffer_set_from_memory,
    load_cluster_key,
    make_transport,
    memory_cells,
    pair_entries,
    shared_memory,
)
from hybridkv.transfer.auth import KEY_ENV, KEY_FILE_ENV, AuthError, Gate, Seal
from hybridkv.transfer.bootstrap import bootstrap_call
from hybridkv.transfer.messages import Heartbeat, Hello, Rank, Status, TransferRequest
from hybridkv.transfer.plan import Route
from hybridkv.transfer.shared import HEADER_BYTES, SharedBuffer, shm_path
from tests.transfer.test_faults import hand_over, prefill_ranks, stage_memory
from tests.transfer.waits import wait_phase, wait_released, wait_until
from tests.transfer.wire import Wire


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


@pytest.fixture
def attacker(stack):
    """A peer on the network without the cluster key."""
    wire = Wire(None)
    stack.callback(wire.close)
    return wire


def transfer(res: Reservations, senders, rid: str, seq_len: int, seed: int):
    """One honest request, end to end; returns its allocation (Success asserted)."""
    hand_over(senders, rid, seq_len, seed)
    alloc = res.request(rid, "pre", seq_len)
    report = res.receiver.wait(rid, 20)
    assert report.phase is Phase.SUCCESS, report
    return alloc, seq_len, seed


def arena_is(mem, landed) -> str:
    return mismatch(mem, expected_arena(mem, [(a.pages, a.slot, n, s) for a, n, s in landed]))


# --- keys and frames ---------------------------------------------------------------------


def test_a_cluster_key_comes_from_the_operator_or_nothing_starts(monkeypatch, tmp_path):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    with pytest.raises(TransferError, match="no cluster key: set \\$HYBRIDKV_CLUSTER_KEY"):
        BootstrapServer()
    key = ClusterKey.generate()
    monkeypatch.setenv(KEY_ENV, key.hex)
    assert load_cluster_key().hex == key.hex
    path = tmp_path / "cluster.key"
    path.write_text(ClusterKey.generate().hex + "\n")
    path.chmod(0o600)  # a key file only its owner reads (tests/transfer/test_cluster_key.py)
    monkeypatch.setenv(KEY_FILE_ENV, str(path))
    assert load_cluster_key().hex == path.read_text().strip()  # the file wins over the variable
    path.write_text("abcd")
    with pytest.raises(TransferError, match="at least 16 bytes"):
        load_cluster_key()
    with pytest.raises(TransferError, match="cannot read the cluster key file"):
        load_cluster_key(str(tmp_path / "missing"))
    assert key.hex not in repr(key)


def test_gate_refuses_no_key_wrong_key_replays_and_misaddressed_frames():
    key, other = ClusterKey.generate(), ClusterKey.generate()
    sender = Rank("d", 0, 0)
    msg = Heartbeat(sender, "tcp://127.0.0.1:1")
    seal, gate = Seal(key, sender), Gate(key)
    first = seal.seal("me", msg)
    with pytest.raises(AuthError, match="without a valid MAC"):
        gate.open(Seal(other, sender).seal("me", msg), "me")  # another cluster's key
    with pytest.raises(AuthError, match="without a valid MAC"):
        gate.open(first[:-1], "me")  # truncated
    with pytest.raises(AuthError, match="without a valid MAC"):
        gate.open(first[:5] + bytes([first[5] ^ 1]) + first[6:], "me")  # one bit flipped
    with pytest.raises(AuthError, match="addressed to 'me'"):
        gate.open(first, "someone else")
    assert gate.open(first, "me").body == msg  # refusals changed nothing: the frame still opens once
    with pytest.raises(AuthError, match="replayed or stale frame from d\\[pp0 tp0\\]: sequence 1 <= 1"):
        gate.open(first, "me")
    second = seal.seal("me", msg)
    restarted = Seal(key, sender)  # a newer epoch
    assert gate.open(restarted.seal("me", msg), "me").epoch == restarted.epoch
    with pytest.raises(AuthError, match="an older epoch"):
        gate.open(second, "me")  # the old incarnation's frames are stale now


# --- item 1: a forged Hello cannot replace a known decode rank ---------------------------


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_forged_hello_cannot_replace_a_known_decode_rank(transport, key, bootstrap, stack, attacker):
    senders = prefill_ranks(key, bootstrap, stack, transport=transport)
    dec, mem = stack.enter_context(decode_rank(bootstrap.address, transport, key=key, checksum=True))
    res = Reservations(dec)
    landed = [transfer(res, senders, "r1", 20, seed=1)]
    assert arena_is(mem, landed) == ""
    fake_bufs = buffer_set_from_memory(stage_memory(0), base_addr=1 << 40)
    forged = Hello(dec.rank, attacker.endpoint, transport, "127.0.0.1:1" if transport == "mooncake" else "", fake_bufs)
    # without the key: refused at the frame, counted, nothing changes
    for s in senders:
        attacker.send(s.endpoint, Seal(ClusterKey.generate(), dec.rank).seal(s.endpoint, forged))
        attacker.send(s.endpoint, msgspec.msgpack.encode(forged))  # the old, unsigned wire format
    wait_until(lambda: all(s.auth_failures == 2 for s in senders))
    # with the key but an older epoch: a stale identity, refused
    for s in senders:
        attacker.send(s.endpoint, Seal(key, dec.rank, epoch=dec.epoch - 1).seal(s.endpoint, forged))
    wait_until(lambda: all(s.auth_failures == 3 and "an older epoch" in s.rejected[-1] for s in senders))
    # the honest decode rank is still served where it registered, byte-exact, r1 untouched
    landed.append(transfer(res, senders, "r2", 27, seed=2))
    assert arena_is(mem, landed) == ""
    # with the key and the decode's own epoch, past its sequence: the identity rule refuses it
    # (such a member can stall the decode rank's frames, never redirect its bytes)
    insider = Seal(key, dec.rank, epoch=dec.epoch)
    insider._seq = itertools.count(1 << 40)
    rejected = [len(s.rejected) for s in senders]
    for s in senders:
        attacker.send(s.endpoint, insider.seal(s.endpoint, forged))
    wait_until(lambda: all(len(s.rejected) == n + 1 for s, n in zip(senders, rejected, strict=True)))
    assert all("only a newer epoch" in s.rejected[-1] for s in senders)
    assert all(s._peers[dec.rank].endpoint == dec.endpoint for s in senders)
    assert attacker.pull.poll(200) == 0  # nothing ever came to the attacker


# --- item 2: a Hello naming any file as the shm session -----------------------------------


def test_hello_naming_a_file_is_refused_before_it_is_opened(key, bootstrap, stack, tmp_path):
    wire = Wire(key)  # even a cluster member cannot make a prefill rank map a file of its choice
    stack.callback(wire.close)
    (stage1,) = prefill_ranks(key, bootstrap, stack, stages=(1,))
    dmem, shared = shared_memory(ShardSpec.whole(get_preset(MODEL)), "1MiB", **MEMORY)
    stack.callback(shared.close)
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(dmem.arena.nbytes))
    pages = dmem.alloc_pages(5)
    cells = {name: c.tolist() for name, c in memory_cells(dmem, pages, int(dmem.alloc_state(1)[0])).items()}
    bufs = buffer_set_from_memory(dmem)
    sessions = {
        "path": f"shm:{victim}:{shared.addr:x}:{shared.nbytes}",
        "dotdot": f"shm:../../{victim}:{shared.addr:x}:{shared.nbytes}",
        "ipc endpoint": f"shm:{shared.token}:{shared.addr:x}:{shared.nbytes}",
    }
    for k, (case, session) in enumerate(sessions.items()):
        me = Rank(f"fake{k}", 0, 0)
        endpoint = f"ipc://{tmp_path}/sock" if case == "ipc endpoint" else wire.endpoint
        wire.send(stage1.endpoint, Hello(me, endpoint, "shm", session, bufs))
        hand_over([stage1], case, 20, seed=3)
        wire.send(stage1.endpoint, TransferRequest(case, 7, me, 20, cells, 5.0, False))
        if case != "ipc endpoint":
            status = wire.recv(Status)
            assert status.phase == "failed" and "not a shm session" in status.reason, status
        else:  # never connects to a socket of the sender's choosing: hello and request refused
            wait_until(lambda: any("never said hello" in r for r in stage1.rejected))
            assert any("is not tcp://host:port" in r for r in stage1.rejected)
    assert victim.read_bytes() == bytes(dmem.arena.nbytes)
    assert mismatch(dmem, np.zeros(dmem.arena.nbytes, np.uint8)) == ""


def test_shm_writer_opens_only_hybridkv_arenas_it_can_check(tmp_path):
    writer = make_transport("shm")
    src = np.arange(256, dtype=np.uint8)
    writer.register(src.ctypes.data, src.size)
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(HEADER_BYTES + 4096))
    token = "ab" * 16
    link = shm_path(token)
    os.symlink(victim, link)
    try:
        with pytest.raises(TransportError, match=r"cannot open shm peer .*hybridkv-abab"):
            writer.write(f"shm:{token}:1000:4096", [src.ctypes.data], [0x1000], [64])  # a link: not followed
    finally:
        os.unlink(link)
    impostor = SharedBuffer(4096)
    try:
        with open(impostor.path, "r+b") as f:  # right name and size, a header that is not hybridkv's
            f.write(b"\0" * 16)
        session = f"shm:{impostor.token}:{impostor.addr:x}:4096"
        with pytest.raises(TransportError, match="header does not describe a hybridkv arena"):
            writer.write(session, [src.ctypes.data], [impostor.addr], [64])
        with pytest.raises(TransportError, match="file has"):
            writer.write(f"shm:{impostor.token}:{impostor.addr:x}:2048", [src.ctypes.data], [impostor.addr], [64])
    finally:
        impostor.close()
    assert victim.read_bytes() == bytes(HEADER_BYTES + 4096)
    writer.close()


# --- item 3: forged heartbeats for a dead peer ---------------------------------------------


def test_forged_heartbeats_do_not_keep_a_silent_prefill_rank_alive(key, bootstrap, stack, attacker):
    wire = Wire(key)
    stack.callback(wire.close)
    (stage0,) = prefill_ranks(key, bootstrap, stack, stages=(0,))
    dead = Rank("pre", 1, 0)  # registered, then silent: a process that died
    claim = wire.register(dead, buffers=buffer_set_from_memory(stage_memory(1)))
    assert bootstrap_call(bootstrap.address, claim, wire.seal(dead)).ok
    dec, _ = stack.enter_context(decode_rank(bootstrap.address, "shm", key=key, timeout_s=30, peer_timeout_s=1.0))
    hand_over([stage0], "r", 20, seed=4)
    start = time.monotonic()
    Reservations(dec).request("r", "pre", 20)
    impostor = Seal(key, dead)  # a key holder in the dead rank's name: another epoch than it registered
    while not dec.status("r").phase.terminal and time.monotonic() - start < 10:
        beat = Heartbeat(dead, wire.endpoint)
        attacker.send(dec.endpoint, Seal(ClusterKey.generate(), dead).seal(dec.endpoint, beat))
        attacker.send(dec.endpoint, impostor.seal(dec.endpoint, beat))
        time.sleep(0.1)
    report = dec.wait("r", 1)
    assert report.phase is Phase.FAILED and "prefill pre[pp1 tp0] silent" in report.reason, report
    assert time.monotonic() - start < 5  # the heartbeat timeout, not the 30 s deadline
    assert dec.auth_failures > 0
    assert any("not a registered source of that epoch" in r for r in dec.rejected)


# --- item 4: quarantine that a stopped writer cannot outlive --------------------------------


def test_a_stopped_writer_cannot_outlive_the_quarantine(key, bootstrap):
    slow = {"slow_s": 0.2, "chunk_bytes": 512}
    requests = [["woken", 40, 5], ["killed", 40, 6]]
    workers = [StageProcess(stage_config(bootstrap.address, "shm", k, requests, **slow), key) for k in (0, 1)]
    try:
        for worker in workers:
            worker.expect("ready", 90)
        with decode_rank(bootstrap.address, "shm", key=key, peer_timeout_s=1.0, quarantine_s=0.3) as (dec, mem):
            res = Reservations(dec)
            for rid in ("woken", "killed"):
                alloc = res.request(rid, "pre", 40)
                wait_phase(dec, rid, Phase.TRANSFERRING)
                workers[1].signal(signal.SIGSTOP)
                assert "pre[pp1 tp0] silent" in wait_phase(dec, rid, Phase.FAILED, 10).reason
                time.sleep(1.0)  # well past quarantine_s: a timer alone must not free the pages
                dec.poll()
                stats = dec.stats()
                assert dec.held == 1 and (stats.quarantined, stats.stuck) == (1, 1) and stats.quarantined_pages == 10
                if rid == "woken":
                    # reuse: another request's pages get bytes; the writer wakes up and may write
                    # into the quarantined pages, never into these
                    pages = mem.alloc_pages(10)
                    slot = int(mem.alloc_state(1)[0])
                    fill(mem, pages, slot, 40, seed=77)
                    before = mem.arena.buffer.numpy().copy()
                    late = expected_arena(mem, [(alloc.pages, alloc.slot, 40, 5)])  # its pages, its pattern
                    workers[1].signal(signal.SIGCONT)
                    wait_released(res, 10)  # its stop acknowledgement releases the pages
                    after = mem.arena.buffer.numpy()
                    changed = after != before
                    assert np.array_equal(after[changed], late[changed])  # only its own pattern, in its pages
                    mem.free_pages(pages)
                    mem.free_state([slot])
                else:
                    workers[1].signal(signal.SIGKILL)  # never acknowledges: released once proven gone
                    wait_released(res, 5)
                    assert dec.stats().quarantined == 0
            mem.verify()
            assert mem.stats().live_pages == 0
    finally:
        for worker in workers:
            worker.close()


# --- item 5: a destination naming an unknown pool -----------------------------------------


def test_a_destination_naming_an_unknown_pool_is_refused(key, bootstrap, stack):
    pre, dec_mem = stage_memory(0), stage_memory(0)
    a, b = buffer_set_from_memory(pre), buffer_set_from_memory(dec_mem)
    route = Route(a, b, pair_entries(a, b))
    pages = dec_mem.alloc_pages(5)
    slot = int(dec_mem.alloc_state(1)[0])
    src = memory_cells(pre, pre.alloc_pages(5), int(pre.alloc_state(1)[0]))
    dst = memory_cells(dec_mem, pages, slot)
    assert route.plan(20, src, dst).nbytes > 0
    with pytest.raises(PlanError, match=r"name pool\(s\) \['bogus'\] it does not have; known pools: \['full'"):
        route.plan(20, src, {**dst, "bogus": dst["full"]})
    with pytest.raises(PlanError, match=r"\['bogus'\]"):
        route.plan(20, None, {**dst, "bogus": dst["full"]})  # decode's own check too
    # over the wire: the prefill rank fails the leg and says which pool
    wire = Wire(key)
    stack.callback(wire.close)
    (stage0,) = prefill_ranks(key, bootstrap, stack, stages=(0,))
    dmem, shared = shared_memory(ShardSpec.whole(get_preset(MODEL)), "1MiB", **MEMORY)
    stack.callback(shared.close)
    link = make_transport("shm", shared)
    stack.callback(link.close)
    me = Rank("fake", 0, 0)
    wire.send(stage0.endpoint, Hello(me, wire.endpoint, "shm", link.session, buffer_set_from_memory(dmem)))
    cells = {n: c.tolist() for n, c in memory_cells(dmem, dmem.alloc_pages(5), int(dmem.alloc_state(1)[0])).items()}
    hand_over([stage0], "odd", 20, seed=8)
    wire.send(stage0.endpoint, TransferRequest("odd", 9, me, 20, {**cells, "bogus": [1]}, 5.0, False))
    failed = wire.recv(Status)  # refused as the request arrives (its destination side is prepared then)
    assert failed.phase == "failed" and "'bogus'" in failed.reason and "known pools" in failed.reason
    assert mismatch(dmem, np.zeros(dmem.arena.nbytes, np.uint8)) == ""


def test_a_restarted_prefill_rank_replaces_its_registration_only_with_a_newer_epoch(key, bootstrap, stack):
    (stage0,) = prefill_ranks(key, bootstrap, stack, stages=(0,))
    link = make_transport("shm")
    stack.callback(link.close)
    again = PrefillSender(stage_memory(0), "pre", bootstrap.address, link, key=key)  # a restart: newer epoch
    stack.callback(again.close)
    reply = bootstrap.lookup("pre")
    assert [r.endpoint for r in reply.ranks] == [again.endpoint] and reply.ranks[0].epoch == again.epoch
    wire = Wire(key)
    stack.callback(wire.close)
    for epoch, says in [(stage0.epoch, "an older epoch"), (again.epoch, "cannot replace it")]:
        insider = Seal(key, stage0.rank, epoch=epoch)
        insider._seq = itertools.count(1 << 40)  # past anything the rank sent: only the epoch rules refuse
        claim = wire.register(stage0.rank, buffers=stage0.buffers, epoch=epoch)
        answer = bootstrap_call(bootstrap.address, claim, insider)
        assert not answer.ok and says in answer.reason
    assert bootstrap.lookup("pre").ranks[0].endpoint == again.endpoint
