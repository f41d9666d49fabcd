"""The prefill->decode demo: real processes, real transports, every byte checked.

Per model, a prefill engine of two pipeline stages, each a separate OS process
(``hybridkv.testing.harness.StageProcess``), fills its pools with the byte ``pattern`` (layer, tensor, page,
offset) for several requests; a decode engine of ``decode_tp`` TP ranks in this process
asks for them over the control plane (bootstrap, per-request messages, checksums) and the
transport writes them. Then every byte of every decode arena is compared with the pattern
(zeros wherever no request landed), every decode memory passes ``verify()`` and ends with
no live page.

Faults, one deliberately broken request each, run alongside the good ones:
- ``slot-size``: a misconfigured decode rank (same model name, other recurrent state
  shape) asks for a request; pairing refuses it before any byte moves.
- ``seq-len``: decode asks for more tokens than prefill computed; both prefill stages
  refuse the leg and say why.

A fresh random cluster key authenticates every control message of the run; the stage
processes get it in their environment.

Invariants: ``ok`` is true only when every good request succeeded on every decode rank,
every faulty one ended Failed with the expected reason, the bytes and memories check out
and every prefill stage reported and exited. Processes, sockets and shared-memory files
are released on every exit path; every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import RECURRENT_POOL, ModelSpec, get_preset
from hybridkv.testing.harness import MEMORY, StageProcess, decode_rank, stage_config, variant
from hybridkv.testing.pattern import expected_arena, mismatch
from hybridkv.testing.reservations import Reservations
from hybridkv.transfer.auth import ClusterKey
from hybridkv.transfer.bootstrap import BootstrapServer
from hybridkv.transfer.decode import Allocation
from hybridkv.transfer.status import Phase, StatusReport
from hybridkv.transfer.transport import transport_class

MODELS = ("tiny-swa2-state", "tiny-gdn")
FAULTS = ("slot-size", "seq-len")
SEQ_LENS = (27, 40, 5, 64, 13, 50, 33, 8)
FAULT_REASON = {"slot-size": "state slot size mismatch", "seq-len": "seq_len mismatch"}
PREFILL_PP = 2
QUARANTINE_S = 3.0  # a failed request still waiting for its writers after this long is reported stuck

DecodeRank = tuple[Reservations, UnifiedMemory]


@dataclass
class _Request:
    rid: str
    model: str
    seq_len: int  # tokens prefill computed
    seed: int
    fault: str = ""  # "" for a good request
    asked: int = 0  # tokens decode asks for
    allocs: dict[int, Allocation] = field(default_factory=dict)  # decode TP rank -> pages


def _requests(models: tuple[str, ...], count: int, faults: tuple[str, ...]) -> list[_Request]:
    out = []
    for m, model in enumerate(models):
        for k in range(count):
            seq_len = SEQ_LENS[(k + m) % len(SEQ_LENS)]
            out.append(_Request(f"{model}/{k}", model, seq_len, 100 * m + k, asked=seq_len))
    for fault in faults:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        model = models[0]
        if fault == "slot-size":
            stateful = [m for m in models if RECURRENT_POOL in get_preset(m).pool_ids()]
            if not stateful:
                raise ValueError(f"the slot-size fault needs a model with recurrent state; {list(models)} have none")
            model = stateful[0]
        seq_len = 27
        asked = seq_len + 2 * MEMORY["page_size"] if fault == "seq-len" else seq_len
        out.append(_Request(f"{model}/bad-{fault}", model, seq_len, 999, fault, asked))
    return out


def _row(req: _Request, rank: str, report: StatusReport) -> dict[str, Any]:
    return {
        "id": req.rid,
        "model": req.model,
        "decode": rank,
        "fault": req.fault,
        "phase": report.phase.label,
        "reason": report.reason,
        "timeline_ms": [[p.label, round(t * 1e3, 3)] for p, t in report.timeline],
        "bytes": report.nbytes,
        "ops": report.ops,
        "time_ms": report.elapsed_s * 1e3,
        "gbps": report.nbytes / report.elapsed_s / 1e9 if report.elapsed_s > 0 else 0.0,
    }


def _settle(res: Reservations, mem: UnifiedMemory, timeout_s: float) -> str:
    """Wait until the receiver holds no pages (quarantines over, failed reservations freed); '' or
    what is wrong."""
    held = res.settle(timeout_s)
    if held:
        return f"{held} requests still hold pages after {timeout_s} s"
    try:
        mem.verify()
    except Exception as exc:  # a broken invariant is a failed check, reported with the rest
        return f"verify() failed: {exc}"
    live = mem.stats().live_pages
    return f"{live} pages still live" if live else ""


def _transfer(
    req: _Request, ranks: list[DecodeRank], rows: list[dict[str, Any]], checks: dict[str, str], timeout_s: float
) -> None:
    """Ask every decode rank for ``req`` at once, wait for each, record rows and checks."""
    for r, (res, _) in enumerate(ranks):
        req.allocs[r] = res.request(req.rid, f"prefill:{req.model}", req.asked)
    for r, (res, _) in enumerate(ranks):
        dec = res.receiver
        report = dec.wait(req.rid, timeout_s + 5)
        rows.append(_row(req, str(dec.rank), report))
        key = f"{req.rid} on {dec.rank}"
        if not req.fault:
            checks[f"{key}: Success"] = "" if report.phase is Phase.SUCCESS else report.reason
            continue
        want = FAULT_REASON[req.fault]
        right = report.phase is Phase.FAILED and want in report.reason
        checks[f"{key}: Failed with {want!r}"] = "" if right else f"ended {report.phase.label}: {report.reason}"
        del req.allocs[r]  # its reservation is freed when the receiver hands it back (_settle)


def _check_bytes(reqs: list[_Request], model: str, tp_rank: int, res: Reservations, mem: UnifiedMemory) -> str:
    """Compare the whole arena with the pattern of what landed, then free those pages."""
    mine = [q for q in reqs if q.model == model and tp_rank in q.allocs]
    landed = [(q.allocs[tp_rank].pages, q.allocs[tp_rank].slot, q.seq_len, q.seed) for q in mine]
    error = mismatch(mem, expected_arena(mem, landed))
    for q in mine:
        res.free(q.rid)
    return error


def run_pd_demo(
    transport: str = "shm",
    models: tuple[str, ...] = MODELS,
    requests: int = 3,
    decode_tp: int = 2,
    faults: tuple[str, ...] = FAULTS,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Run the demo; the report says per request and decode rank what happened."""
    if not models:
        raise ValueError("pd-demo needs at least one model")
    transport_class(transport)  # refuses an unknown name before any process starts
    reqs = _requests(models, requests, faults)
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    checks: dict[str, str] = {}  # what was checked -> '' (passed) or what went wrong
    key = ClusterKey.generate()
    with contextlib.ExitStack() as stack:
        boot = BootstrapServer(key=key).start()
        stack.callback(boot.close)

        def decode(model: str | ModelSpec, engine: str, tp: int = 1, tp_rank: int = 0, **kw: Any) -> DecodeRank:
            rank = decode_rank(
                boot.address, transport, tp, tp_rank, model, engine=engine, key=key, timeout_s=timeout_s, **kw
            )
            receiver, mem = stack.enter_context(rank)
            return Reservations(receiver), mem

        stages: dict[str, list[StageProcess]] = {}
        for model in models:
            served = [(r.rid, r.seq_len, r.seed) for r in reqs if r.model == model and r.fault != "slot-size"]
            engine = f"prefill:{model}"
            stages[model] = []
            for pp_rank in range(PREFILL_PP):
                stage = StageProcess(
                    stage_config(
                        boot.address, transport, pp_rank, served, model=model, engine=engine, timeout_s=timeout_s
                    ),
                    key,
                )
                stack.callback(stage.close)
                stages[model].append(stage)
        decoders = {
            model: [
                decode(model, f"decode:{model}", decode_tp, r, checksum=True, quarantine_s=QUARANTINE_S)
                for r in range(decode_tp)
            ]
            for model in models
        }
        misconfigured = [
            decode(variant(r.model, state_dim=4), "decode:misconfigured", quarantine_s=QUARANTINE_S)
            for r in reqs
            if r.fault == "slot-size"
        ]
        for stage in (s for procs in stages.values() for s in procs):
            stage.expect("ready", 90)  # importing torch takes seconds on a loaded host
        ready = time.monotonic()

        for req in reqs:  # one request at a time (on all its decode ranks): clean per-request timings
            _transfer(req, misconfigured if req.fault == "slot-size" else decoders[req.model], rows, checks, timeout_s)
        done = time.monotonic()

        for model, ranks in decoders.items():
            for r, (res, mem) in enumerate(ranks):
                checks[f"{res.receiver.rank}: every arena byte equals the pattern"] = _check_bytes(
                    reqs, model, r, res, mem
                )
        for res, mem in [rank for ranks in decoders.values() for rank in ranks] + misconfigured:
            dec = res.receiver
            checks[f"{dec.rank}: memory verify() and no live page"] = _settle(res, mem, QUARANTINE_S + 5)
            refused = dec.stats().auth_failures
            checks[f"{dec.rank}: every control frame authenticated"] = f"{refused} frames refused" if refused else ""

        prefill = []
        for model, procs in stages.items():
            served_count = sum(r.model == model and r.fault != "slot-size" for r in reqs)
            for pp_rank, stage in enumerate(procs):
                name = f"prefill:{model}[pp{pp_rank}]"
                try:
                    prefill += [
                        {"stage": name, **stage.expect("report", timeout_s)["report"]} for _ in range(served_count)
                    ]
                    exit_event = stage.expect("exit", 15)
                    checks[f"{name}: reported every request and exited cleanly"] = (
                        "" if exit_event.get("exit") == 0 else f"exit event {exit_event}"
                    )
                except TimeoutError as exc:
                    checks[f"{name}: reported every request and exited cleanly"] = str(exc)
    return {
        "transport": transport,
        "models": list(models),
        "prefill": {"pp": PREFILL_PP, "tp": 1, "processes": PREFILL_PP * len(models)},
        "decode": {"tp": decode_tp},
        "faults": list(faults),
        "startup_s": ready - start,
        "transfer_s": done - ready,
        "total_s": time.monotonic() - start,
        "requests": rows,
        "prefill_reports": prefill,
        "bytes_verified": sum(r["bytes"] for r in rows if r["phase"] == "Success"),
        "checks": [{"check": name, "ok": not error, "error": error} for name, error in checks.items()],
        "ok": not any(checks.values()),
    }
