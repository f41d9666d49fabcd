"""Prefill on ``prefill_pp`` pipeline stages, decode on ``decode_tp`` tensor-parallel ranks, one process each.

``run_pd(PDConfig(model_dir, prompts, max_new))`` checks the layout in the calling process
(``check_layout``: every stage and rank's shard can be built), then launches ``P + T`` processes
(``engine.parallel.launch``; gloo on CPU): world ranks ``0..P-1`` are the prefill stages,
``P..P+T-1`` the decode TP ranks. The launching process runs the transfer bootstrap; a fresh
cluster key authenticates every control frame (``PrefillSender`` per stage, ``DecodeReceiver``
per decode rank). KV and state move over the shm transport into the decode ranks' shared
arenas, paired by global layer id and sliced for each decode TP rank by the transfer plan.

Per request, one at a time, on every rank in the same order: each decode rank asks for it
(``DecodeReceiver.request`` reserves its pages and slot); the prefill stages run the chunked
prefill (hidden states stage to stage) and hand the request to their senders; the last stage
sends the first greedy token to every decode rank (``torch.distributed`` point to point);
the decode ranks wait for Success from every stage, adopt the pages and slot as a request of
their own allocator and decode greedily (TP all-reduce), then free it.

Invariants:
- A decode rank decodes a request only after every prefill stage reported Success to it;
  any other outcome raises on that rank, which ends the whole launch with its reason.
- Prefill keeps a request's window pages until its senders finished (no tombstone is sent);
  decode releases the ones out of the window after its first step, as for any request.
- Timings (``PDResult.timings``, one ``RequestTiming`` per prompt) come from ``time.monotonic``
  stamps taken in the processes (CLOCK_MONOTONIC: one clock for every process of a machine).
  Every request arrives when prefill stage 0 leaves the start barrier; each stage serves one
  request at a time, so a request queues until stage 0 has sent the ones before it.
- Every process ends holding no request's page or slot (``mem.verify()``; live counts before
  and after come back in ``PDRank``) and closes its sender or receiver and transport; ``launch`` reaps every process
  on every exit path, and the bootstrap closes with the launch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridkv.engine.allocator import RequestAllocator, RequestMemory
from hybridkv.engine.batch import ForwardBatch
from hybridkv.engine.engine import engine_spec
from hybridkv.engine.parallel.groups import StageGroups
from hybridkv.engine.parallel.launch import launch
from hybridkv.engine.parallel.runner import ShardRunner
from hybridkv.engine.registry import text_config
from hybridkv.engine.weights import read_config
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import Parallel, ShardSpec
from hybridkv.transfer import (
    BootstrapServer,
    DecodeReceiver,
    Phase,
    PrefillSender,
    StatusReport,
    TransferError,
    make_transport,
    shared_memory,
)
from hybridkv.transfer.auth import ClusterKey

PREFILL_ENGINE = "pd-prefill"
DECODE_ENGINE = "pd-decode"


@dataclass(frozen=True)
class PDConfig:
    model_dir: str  # config.json + *.safetensors
    prompts: tuple[tuple[int, ...], ...]
    max_new: int
    prefill_pp: int = 2
    decode_tp: int = 2
    page_size: int = 16
    chunk: int = 64
    gpu_memory: int = 8_000_000  # bytes per process
    max_context: int = 256
    timeout_s: float = 60.0  # per transfer and per collective


@dataclass(frozen=True)
class PDRank:
    role: str  # "prefill" or "decode"
    index: int  # PP rank (prefill) or TP rank (decode)
    pid: int
    output_ids: tuple[tuple[int, ...], ...]  # decode: every request's tokens; prefill: () except the last stage
    transfer_bytes: tuple[int, ...]  # per request, as this rank's transfer reported them
    live_before: tuple[int, int]  # (pages, slots) live before the first request (reserved ids)
    live_after: tuple[int, int]  # and at the end: equal when nothing leaked
    start: float  # time.monotonic() when this rank left the start barrier
    stamps: tuple[tuple[float, float], ...]  # per request; prefill: (started, first token), decode: (received, done)


@dataclass(frozen=True)
class RequestTiming:
    """One request's seconds; ``queue + prefill`` is the TTFT, ``transfer`` and ``decode`` follow it."""

    queue_s: float  # arrival -> prefill stage 0 starts it
    prefill_s: float  # -> the last stage has the first token
    transfer_s: float  # -> every decode rank holds every stage's KV/state (Success from every sender)
    decode_s: float  # -> the slowest decode rank has the last token
    ttft_s: float  # arrival -> first token
    tpot_s: float  # decode seconds per token after the first (0 when only one token)


@dataclass(frozen=True)
class PDResult:
    output_ids: list[list[int]]  # per prompt, greedy, ``max_new`` tokens
    ranks: list[PDRank]
    timings: list[RequestTiming]  # per prompt, input order


def run_pd(config: PDConfig) -> PDResult:
    """Serve ``config.prompts`` disaggregated; every decode rank must agree on every token."""
    if config.prefill_pp < 1 or config.decode_tp < 1 or config.max_new < 1:
        raise ValueError(f"run_pd needs prefill_pp, decode_tp and max_new >= 1, got {config}")
    if not config.prompts or not all(config.prompts):
        raise ValueError("run_pd needs at least one prompt, each of at least one token")
    check_layout(config)
    key = ClusterKey.generate()
    boot = BootstrapServer(key=key).start()
    try:
        world = config.prefill_pp + config.decode_tp
        ranks: list[PDRank] = launch(
            _serve_rank,
            world,
            (config, boot.address, key.hex),
            timeout_s=config.timeout_s * (2 + len(config.prompts)),
            collective_timeout_s=config.timeout_s,
        )
    finally:
        boot.close()
    decoded = [r.output_ids for r in ranks if r.role == "decode"]
    if any(d != decoded[0] for d in decoded):
        raise TransferError(f"decode ranks disagree on the tokens: {decoded}")
    return PDResult([list(t) for t in decoded[0]], ranks, _timings(ranks, config))


def check_layout(config: PDConfig) -> None:
    """Raise ``ValueError`` (naming the size to change) unless every prefill stage and decode rank can be built."""
    spec = engine_spec(text_config(read_config(config.model_dir)))
    for stage in range(config.prefill_pp):
        ShardSpec(spec, Parallel(pp_size=config.prefill_pp), stage, 0)
    for rank in range(config.decode_tp):
        ShardSpec(spec, Parallel(tp_size=config.decode_tp), 0, rank)


def _timings(ranks: list[PDRank], config: PDConfig) -> list[RequestTiming]:
    first = next(r for r in ranks if r.role == "prefill" and r.index == 0)
    last = next(r for r in ranks if r.role == "prefill" and r.index == config.prefill_pp - 1)
    decodes = [r for r in ranks if r.role == "decode"]
    out = []
    for i in range(len(config.prompts)):
        started, token = first.stamps[i][0], last.stamps[i][1]
        received = max(d.stamps[i][0] for d in decodes)
        decode = max(d.stamps[i][1] - d.stamps[i][0] for d in decodes)
        out.append(
            RequestTiming(
                queue_s=started - first.start,
                prefill_s=token - started,
                transfer_s=max(0.0, received - token),
                decode_s=decode,
                ttft_s=token - first.start,
                tpot_s=decode / (config.max_new - 1) if config.max_new > 1 else 0.0,
            )
        )
    return out


def _serve_rank(rank: int, config: PDConfig, bootstrap: str, key_hex: str) -> PDRank:
    key = ClusterKey.from_hex(key_hex, "run_pd")
    p, t = config.prefill_pp, config.decode_tp
    prefill = StageGroups.create(Parallel(pp_size=p), range(p), config.timeout_s)
    decode = StageGroups.create(Parallel(tp_size=t), range(p, p + t), config.timeout_s)
    if prefill is not None:
        return _prefill(config, prefill, bootstrap, key)
    assert decode is not None
    return _decode(config, decode, bootstrap, key)


def _live(mem: UnifiedMemory) -> tuple[int, int]:
    return int(mem.pages.capacity - mem.pages.free_count), int(mem.slots.capacity - mem.slots.free_count)


def _rid(i: int) -> str:
    return f"request-{i}"


def _finished(report: StatusReport | None, where: str) -> bool:
    if report is None or not report.phase.terminal:
        return False
    if report.phase is not Phase.SUCCESS:
        raise TransferError(f"{where}: {report.request_id} ended {report.phase.label}: {report.reason}")
    return True


def _prefill(config: PDConfig, groups: StageGroups, bootstrap: str, key: ClusterKey) -> PDRank:
    runner = ShardRunner(
        config.model_dir,
        config.model_dir,
        groups.parallel,
        groups.pp_rank,
        0,
        groups,
        gpu_memory=config.gpu_memory,
        page_size=config.page_size,
        chunk_size=config.chunk,
        max_context=config.max_context,
    )
    mem, where = runner.mem, f"prefill stage {groups.pp_rank}"
    transport = make_transport("shm")
    sender = PrefillSender(mem, PREFILL_ENGINE, bootstrap, transport, key=key, timeout_s=config.timeout_s)
    alloc = RequestAllocator(mem, prefix_cache=False)
    firsts, nbytes, stamps, before = [], [], [], _live(mem)
    try:
        dist.barrier()  # every sender registered, every receiver up
        ready = time.monotonic()
        for i, ids in enumerate(config.prompts):
            started = time.monotonic()
            req = alloc.new()
            alloc.admit(req, ids, len(ids), config.chunk, 0, force=True)
            for start in range(0, len(ids), config.chunk):
                piece = list(ids[start : start + config.chunk])
                prefix = req.length
                alloc.extend([req], [len(piece)])
                logits = runner.forward(_batch(req, piece, prefix))
                req.fresh = False  # window pages stay until the senders finished
            first = torch.argmax(logits[0]).reshape(1)
            stamps.append((started, time.monotonic()))
            if groups.last:
                firsts.append(int(first))
                for d in range(config.prefill_pp, config.prefill_pp + config.decode_tp):
                    dist.send(first, dst=d)
            sender.send(_rid(i), req.live.pages, req.slot, req.length)
            end = time.monotonic() + config.timeout_s
            while not _finished(sender.status(_rid(i)), where):
                if time.monotonic() > end:
                    raise TimeoutError(f"{where}: {_rid(i)} not sent after {config.timeout_s} s")
                time.sleep(0.001)
            sender.poll()  # unpins the request
            report = sender.status(_rid(i))
            nbytes.append(report.nbytes if report is not None else 0)
            alloc.retract(req)
        mem.verify()
    finally:
        sender.close()
        transport.close()
    outputs = (tuple(firsts),) if groups.last else ()
    return PDRank(
        "prefill", groups.pp_rank, os.getpid(), outputs, tuple(nbytes), before, _live(mem), ready, tuple(stamps)
    )


def _decode(config: PDConfig, groups: StageGroups, bootstrap: str, key: ClusterKey) -> PDRank:
    spec = engine_spec(text_config(read_config(config.model_dir)))
    shard = ShardSpec(spec, groups.parallel, 0, groups.tp_rank)
    mem, shared = shared_memory(
        shard, config.gpu_memory, page_size=config.page_size, max_context=config.max_context, chunk_tokens=config.chunk
    )
    link = make_transport("shm", shared)
    where, before = f"decode TP rank {groups.tp_rank}", _live(mem)
    try:
        runner = ShardRunner(
            config.model_dir, config.model_dir, groups.parallel, 0, groups.tp_rank, groups, spec=spec, mem=mem
        )
        receiver = DecodeReceiver(mem, DECODE_ENGINE, bootstrap, link, key=key, timeout_s=config.timeout_s)
        try:
            outputs, nbytes, ready, stamps = _decode_all(config, runner, receiver, where)
        finally:
            receiver.close()
        mem.verify()
    finally:
        link.close()
        shared.close()
    return PDRank("decode", groups.tp_rank, os.getpid(), outputs, nbytes, before, _live(mem), ready, stamps)


def _decode_all(
    config: PDConfig, runner: ShardRunner, receiver: DecodeReceiver, where: str
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], float, tuple[tuple[float, float], ...]]:
    mem = runner.mem
    alloc = RequestAllocator(mem, prefix_cache=False)
    outputs, nbytes, stamps = [], [], []
    dist.barrier()
    ready = time.monotonic()
    for i, ids in enumerate(config.prompts):
        got = receiver.request(_rid(i), PREFILL_ENGINE, len(ids))
        first = torch.empty(1, dtype=torch.int64)
        dist.recv(first, src=config.prefill_pp - 1)
        report = receiver.wait(_rid(i), config.timeout_s)
        _finished(report, where)
        nbytes.append(report.nbytes)
        received = time.monotonic()
        req = alloc.new()  # the transferred pages and slot become a request of this rank's allocator
        alloc.adopt(req, got.pages, len(ids), got.slot)
        tokens = [int(first)]
        while len(tokens) < config.max_new:
            prefix = req.length
            alloc.extend([req], [1])
            logits = runner.forward(_batch(req, tokens[-1:], prefix))
            alloc.mark_computed([req])
            tokens.append(int(torch.argmax(logits[0])))
        alloc.retract(req)
        stamps.append((received, time.monotonic()))
        outputs.append(tuple(tokens))
    return tuple(outputs), tuple(nbytes), ready, tuple(stamps)


def _batch(req: RequestMemory, ids: list[int], prefix: int) -> ForwardBatch:
    if req.slot is None:
        return ForwardBatch.build([ids], [prefix], [req.token_locs], None, None)
    return ForwardBatch.build([ids], [prefix], [req.token_locs], [req.slot], [req.fresh])
