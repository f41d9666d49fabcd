"""Prefill PP stages in separate processes -> decode, over both transports, byte-exact;
and peers killed or hung mid-transfer."""

from __future__ import annotations

import contextlib
import signal

import pytest

from hybridkv.testing.harness import StageProcess, decode_rank, stage_config
from hybridkv.testing.pattern import expected_arena, mismatch
from hybridkv.testing.reservations import Reservations
from hybridkv.transfer import BootstrapServer, Phase
from tests.transfer.waits import wait_phase, wait_released, wait_until

REQUESTS = [["a", 27, 11], ["b", 40, 12], ["c", 5, 13]]


@pytest.fixture
def bootstrap(key):
    server = BootstrapServer(key=key).start()
    yield server.address
    server.close()


@pytest.fixture
def spawn(key):
    workers: list[StageProcess] = []

    def start(cfg: dict) -> StageProcess:
        workers.append(StageProcess(cfg, key))
        return workers[-1]

    yield start
    for worker in workers:
        worker.close()


@pytest.mark.parametrize(("transport", "decode_tp"), [("shm", 2), ("mooncake", 1)])
def test_pp_stage_processes_write_every_byte_into_place(transport, decode_tp, key, bootstrap, spawn):
    workers = [spawn(stage_config(bootstrap, transport, k, REQUESTS)) for k in (0, 1)]
    with contextlib.ExitStack() as stack:
        ranks = [
            stack.enter_context(
                decode_rank(bootstrap, transport, key=key, tp=decode_tp, tp_rank=r, checksum=True, timeout_s=120)
            )
            for r in range(decode_tp)
        ]
        # asked before the prefill ranks registered: the lookup waits for both stages
        owners = [Reservations(dec) for dec, _ in ranks]
        allocs = [{rid: res.request(rid, "pre", n) for rid, n, _ in REQUESTS} for res in owners]
        for worker in workers:
            worker.expect("ready", 90)  # slow only when the host is loaded: importing torch
        for (dec, mem), res, alloc in zip(ranks, owners, allocs, strict=True):
            for rid in alloc:
                report = dec.wait(rid, 30)
                assert report.phase is Phase.SUCCESS, (report, [w.describe() for w in workers])
                assert [p for p, _ in report.timeline] == list(Phase)[:4]  # every phase, in order
                assert [t for _, t in report.timeline] == sorted(t for _, t in report.timeline)
            want = expected_arena(mem, [(alloc[r].pages, alloc[r].slot, n, s) for r, n, s in REQUESTS])
            assert mismatch(mem, want) == ""
            assert dec.held == 0 and not dec.rejected
            for rid in alloc:
                res.free(rid)
            mem.verify()
    for worker in workers:
        phases = {worker.expect("report")["report"]["phase"] for _ in REQUESTS}
        assert phases == {"Success"}
        assert len(worker.expect("exit")["done"]) == len(REQUESTS)


def test_prefill_hung_then_killed_mid_transfer(key, bootstrap, spawn):
    slow = {"slow_s": 0.2, "chunk_bytes": 512}
    requests = [["hung", 40, 5], ["killed", 40, 6]]
    workers = [spawn(stage_config(bootstrap, "shm", k, requests, **slow)) for k in (0, 1)]
    for worker in workers:
        worker.expect("ready", 90)
    with decode_rank(bootstrap, "shm", key=key, peer_timeout_s=1.0, quarantine_s=60.0) as (dec, mem):
        res = Reservations(dec)
        # hung (SIGSTOP): fails on heartbeat timeout, pages quarantined until it acknowledges
        res.request("hung", "pre", 40)
        wait_phase(dec, "hung", Phase.TRANSFERRING)
        workers[1].signal(signal.SIGSTOP)
        report = wait_phase(dec, "hung", Phase.FAILED, 10)
        assert "pre[pp1 tp0] silent" in report.reason and "heartbeat timeout" in report.reason
        # stage 0 acknowledges the abort (its leg ends) while the hung stage 1 cannot
        wait_until(lambda: dec.status("hung").leg("pre[pp0 tp0]").terminal)
        dec.poll()
        assert not dec.status("hung").leg("pre[pp1 tp0]").terminal  # asked or transferring when stopped
        assert dec.held == 1  # the hung writer may still write: not freed yet
        workers[1].signal(signal.SIGCONT)
        wait_released(res, 10)  # its stop acknowledgement frees the pages long before 60 s
        mem.verify()
        for worker in workers:
            assert worker.expect("report")["report"]["phase"] == "Failed"

        # killed (SIGKILL): never acknowledges, freed once the quarantine ends
        dec.quarantine_s = 1.0
        res.request("killed", "pre", 40)
        wait_phase(dec, "killed", Phase.TRANSFERRING)
        workers[1].signal(signal.SIGKILL)
        report = wait_phase(dec, "killed", Phase.FAILED, 10)
        assert "pre[pp1 tp0] silent" in report.reason
        wait_released(res, 5)
        mem.verify()
        assert mem.stats().live_pages == 0
    survivor = workers[0].expect("report")["report"]
    assert survivor["phase"] == "Failed" and "aborted by decode" in survivor["reason"]
