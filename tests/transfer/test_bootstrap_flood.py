"""What a peer without the key costs the bootstrap router (issue 19 item 6): before, every
refused frame appended its reason to an unbounded list and logged one warning, so 100k junk
frames grew the router by ~22 MB and 100k log lines. Now the reasons are a capped ring, the
log is rate-limited with a count of what it did not print, and the counters count every frame."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from hybridkv.transfer import BootstrapServer, ClusterKey
from hybridkv.transfer.auth import Seal
from hybridkv.transfer.bootstrap import bootstrap_call
from hybridkv.transfer.messages import Lookup, LookupReply, Rank

JUNK = 20_000
WINDOW = 500  # junk frames in flight at most (half the router's send queue)


def test_junk_frames_cost_a_bounded_ring_and_bounded_log_lines(key, caplog):
    server = BootstrapServer(key=key).start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    # the router never blocks on a slow reader: past its send queue's high-water mark (1000 by default) it drops its
    # replies (a reader that waited 3 s got 18,500 of 20,000). Unbounded receiving alone was not enough on a loaded
    # machine (19,766 and 19,962 arrived: the queue filled while this reader was descheduled), so at most WINDOW
    # frames are in flight: every reply arrives, however slow this reader
    sock.rcvhwm = 0
    try:
        caplog.set_level(logging.WARNING, logger="hybridkv.transfer")
        sock.connect(server.address)
        forged = Seal(ClusterKey.generate(), Rank("x", 0, 0))  # another cluster's key: well formed, a wrong MAC
        frames = [b"\x00" * (i % 64 + 1) for i in range(JUNK // 2)]
        frames += [forged.seal("bootstrap", Lookup("pre")) for _ in range(JUNK // 2)]
        replies, sent, end = 0, 0, time.monotonic() + 60
        while replies < JUNK and time.monotonic() < end:
            while sent < JUNK and sent - replies < WINDOW:
                sock.send(frames[sent])
                sent += 1
            if sock.poll(1000):
                sock.recv()
                replies += 1
        assert replies == JUNK  # every junk frame was answered (refused), none dropped silently
        assert server.auth_failures == JUNK
        assert len(server.rejected) <= 1000, f"{len(server.rejected)} refusal reasons kept for {JUNK} frames"
        lines = [r for r in caplog.records if r.name == "hybridkv.transfer"]
        assert len(lines) <= 20, f"{len(lines)} log lines for {JUNK} refused frames"
        assert server.refused == JUNK  # the counter counts every refusal the ring and the log leave out
        assert "without a valid MAC" in server.rejected[-1]
        # an honest client is still served
        reply = bootstrap_call(server.address, Lookup("pre"), Seal(key, Rank("d", 0, 0)))
        assert isinstance(reply, LookupReply) and not reply.complete
    finally:
        sock.close(linger=0)
        ctx.term()
        server.close()
    # closing says how many refusals were not logged one by one
    messages = [r.getMessage() for r in caplog.records if r.name == "hybridkv.transfer"]
    summary = [m for m in messages if "not logged one by one" in m]
    one_by_one = [m for m in messages if "refused a message" in m]
    assert summary, "the count of refusals left out of the log is never said"
    assert len(one_by_one) + sum(int(m.split()[0]) for m in summary) == JUNK


@pytest.mark.parametrize("burst", [1, 3])
def test_the_log_limiter_counts_what_it_drops(burst, caplog):
    from hybridkv.transfer.refusals import Refusals

    caplog.set_level(logging.WARNING, logger="hybridkv.transfer")
    log = logging.getLogger("hybridkv.transfer")
    refusals = Refusals(log, "test", keep=4, burst=burst, period_s=3600)
    for i in range(10):
        refusals.add(f"reason {i}")
    assert refusals.count == 10 and list(refusals.recent) == [f"reason {i}" for i in range(6, 10)]
    assert len(caplog.records) == burst
    refusals.flush()
    assert caplog.records[-1].getMessage().startswith(f"{10 - burst} refusals by test not logged")
    refusals.flush()  # nothing more to say
    assert len(caplog.records) == burst + 1
