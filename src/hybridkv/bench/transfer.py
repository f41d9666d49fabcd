"""``hybridkv bench transfer``: transfer GB/s by page size and batch size, side by side with a
raw baseline moving the same bytes between the same two memories, in the same run.

Setup: one prefill rank and one decode rank in this process, each with its own
``UnifiedMemory`` (the decode arena in shared memory for shm), a bootstrap, a
``PrefillSender`` and a ``DecodeReceiver``. The model is 4 full-attention layers, 8 KV
heads of 128, bf16: 16 KiB per token, so a page of ``t`` tokens is one ``16 t`` KiB cell.
The request's prefill pages are in random order, so each page is one op.

Measured per (page size, batch), warm, interleaved in a random order drawn anew for each of the ``reps``
repetitions, median of ``reps`` (GB/s per path; ratios are the median of per-repetition ratios). (A rotation
of one fixed order ran ``baseline`` right after ``hybridkv`` in all repetitions but one, on the bytes
``hybridkv`` had just brought into the caches: measured, the shm ratio at 64 KiB x 16 was 0.56-0.63 in that
order and 0.76-0.77 in a random one, the same code.)
- ``hybridkv``: what a prefill rank does per request once its forward ended:
  ``Route.complete`` (the source cells added to the destination side prepared when the
  decode rank's request arrived, ``Route.prepare``, which ``PrefillSender`` does while the
  forward runs; all checks) plus ``write_plan`` through the transport;
- ``baseline``: the same bytes moved raw, with no plan and no checks: the prefill side's
  transport's ``raw_write`` of the very same ops (each transport class declares it and its
  goal, ``Transport.bench_goal``; a transport without one is benched with no baseline, and its
  report says so). shm: one ``memmove`` per op into the prefill side's mapping of the decode
  rank's shared memory (a second mapping of the same pages, as a prefill process has: writing
  through the decode rank's own mapping in this process was ~10 µs faster per 1 MiB batch than
  any prefill process can be, which the ratio then charged to hybridkv); mooncake: one
  ``batch_transfer_sync_write`` of the very same ops on the same engines;
- ``memcpy_block`` (transports whose goal has a ``copy_bound``: shm): one contiguous
  ``memmove`` of as many bytes, the copy's upper bound, for reference;
- ``end_to_end``: ``DecodeReceiver.request`` to Success through the control plane (alloc,
  pin, messages, plan, write, status, free), for reference. It runs after the other paths, not
  among them: it touches far more memory and code (new pages, messages, threads) and left
  whichever path came next cold. Measured, same code, shm 64 KiB x 16, right after it / right
  after itself: raw 63 / 46 us, hybridkv 82 / 62 us; the ratio in 4 alternating runs 0.72-0.80
  with it interleaved, 0.79-0.83 apart (``overhead_us`` 14-17 and 8-11).

Goals (against ``baseline``, each transport's ``bench_goal``): shm ``>= 0.8 x`` for pages >= 64 KiB;
mooncake ``>= 0.9 x``.
``overhead_us`` (median hybridkv minus median baseline time) is the per-request fixed cost
of planning and checking after the forward, which decides the ratio of small requests;
``plan_us`` is the median time of ``Route.complete`` alone (the critical path's planning,
before a byte moves), ``prepare_us`` that of ``Route.prepare`` (the destination side, done
ahead of the forward's end: off the critical path, yet hybridkv's work all the same) and
``unprepared_plan_us`` that of ``Route.plan`` (both at once, as a caller that never
prepares pays it).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import FullAttention, ModelSpec, ShardSpec
from hybridkv.transfer import (
    Allocation,
    BootstrapServer,
    ClusterKey,
    DecodeReceiver,
    Phase,
    PrefillSender,
    make_transport,
    memory_cells,
    pair_entries,
    shared_memory,
)
from hybridkv.transfer.plan import Route
from hybridkv.transfer.transport import transport_class, write_plan
from hybridkv.transfer.transport.base import BenchGoal

MODEL = ModelSpec.from_kinds(
    "bench-dense-4x8x128-bf16", [FullAttention(8, 128, 128)] * 4, kv_dtype=torch.bfloat16, max_context=1 << 20
)
TOKEN_BYTES = 16 << 10
NO_BASELINE = "none: the {} transport declares no raw baseline (Transport.bench_goal is None)"
CHUNK_BYTES = 64 << 20
_REQUEST_IDS = itertools.count()  # request ids are never reused: a reused id is refused


def _goal_text(goal: BenchGoal) -> str:
    kib = goal.from_page_bytes >> 10
    return f"hybridkv >= {goal.ratio} x baseline" + (f" for pages >= {kib} KiB" if goal.from_page_bytes else "")


def _paired_ratio(times: dict[str, list[float]], baseline: str) -> float:
    """Median over repetitions of baseline time / hybridkv time, each pair run back to back
    (robust to load that drifts during the run)."""
    return statistics.median(b / h for b, h in zip(times[baseline], times["hybridkv"], strict=True))


def _timer(fn: Callable[[], object]) -> Callable[[], float]:
    def timed() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return timed


@contextlib.contextmanager
def _ranks(transport: str, page_tokens: int, max_batch: int) -> Iterator[tuple[PrefillSender, DecodeReceiver]]:
    """A prefill and a decode rank of ``MODEL`` with room for ``max_batch`` pages each."""
    shard = ShardSpec.whole(MODEL)
    page_bytes = TOKEN_BYTES * page_tokens
    budget = page_bytes * (2 * max_batch + 32)
    hints: dict[str, Any] = {
        "page_size": page_tokens,
        "max_context": page_tokens * max_batch,
        "chunk_tokens": page_tokens,
    }
    with contextlib.ExitStack() as stack:
        key = ClusterKey.generate()
        boot = BootstrapServer(key=key).start()
        stack.callback(boot.close)
        pre = UnifiedMemory.create(shard, budget, **hints)
        shared = None
        if transport_class(transport).shared_arena:
            dec, shared = shared_memory(shard, budget, **hints)
            stack.callback(shared.close)
        else:
            dec = UnifiedMemory.create(shard, budget, **hints)
        pre.arena.buffer.fill_(7)  # touch every page once: no first-fault costs in the timings
        dec.arena.buffer.zero_()
        pre_link, dec_link = make_transport(transport), make_transport(transport, shared)
        stack.callback(pre_link.close)
        stack.callback(dec_link.close)
        sender = PrefillSender(pre, "bench-prefill", boot.address, pre_link, key=key)
        stack.callback(sender.close)
        receiver = DecodeReceiver(dec, "bench-decode", boot.address, dec_link, key=key)
        stack.callback(receiver.close)
        yield sender, receiver


def _case(
    transport: str, sender: PrefillSender, receiver: DecodeReceiver, batch: int, reps: int, rng: np.random.Generator
) -> dict[str, Any]:
    pre, dec = sender.mem, receiver.mem
    page_tokens = pre.page_size
    seq_len = batch * page_tokens
    pages = rng.permutation(pre.alloc_pages(batch))
    dst_pages = dec.alloc_pages(batch)
    route = Route(sender.buffers, receiver.buffers, pair_entries(sender.buffers, receiver.buffers))
    src_cells = memory_cells(pre, pages, None)  # as ``PrefillSender.send`` has them
    dst_cells = {n: c.tolist() for n, c in memory_cells(dec, dst_pages, None).items()}  # as decode's message has them
    peer = receiver.transport.session

    dest = route.prepare(seq_len, dst_cells)  # as ``PrefillSender`` does when decode's request arrives

    def hybridkv() -> None:
        plan = route.complete(dest, src_cells)
        write_plan(sender.transport, peer, plan, CHUNK_BYTES, lambda: "")

    plan = route.plan(seq_len, src_cells, dst_cells)
    nbytes = plan.nbytes
    ops = (plan.src.tolist(), plan.dst.tolist(), plan.length.tolist())
    paths: dict[str, Callable[[], object]] = {"hybridkv": hybridkv}
    goal = transport_class(transport).bench_goal
    if goal is not None:

        def raw() -> None:
            sender.transport.raw_write(peer, *ops)

        paths["baseline"] = raw
    if goal is not None and goal.copy_bound:
        src0, dst0 = pre.arena.buffer.data_ptr(), dec.arena.buffer.data_ptr()

        def memcpy_block() -> None:
            ctypes.memmove(dst0 + dec.arena.sink_bytes, src0 + pre.arena.sink_bytes, nbytes)

        paths["memcpy_block"] = memcpy_block

    def end_to_end() -> None:
        rid = f"bench-{next(_REQUEST_IDS)}"
        alloc = Allocation(dec.alloc_pages(batch), None)  # the bench owns both sides' memory
        receiver.request(rid, "bench-prefill", seq_len, reserved=alloc)
        gate = pre.pin(pages=pages)
        sender.send(rid, pages, None, seq_len, pinned=gate)
        report = receiver.wait(rid, 60)
        if report.phase is not Phase.SUCCESS:
            raise RuntimeError(f"bench request failed: {report.reason}")
        while not sender.poll():
            time.sleep(0.0002)
        gate.release()
        dec.free_pages(alloc.pages)

    def planning() -> None:
        route.complete(dest, src_cells)

    def preparing() -> None:
        route.prepare(seq_len, dst_cells)

    def unprepared() -> None:
        route.plan(seq_len, src_cells, dst_cells)

    paths |= {"plan": planning, "prepare": preparing, "unprepared_plan": unprepared}
    timers = {name: _timer(fn) for name, fn in paths.items()}
    for timed in timers.values():  # warm-up: mappings, handshakes, caches
        timed()
    times: dict[str, list[float]] = {name: [] for name in timers}
    names = list(timers)
    for _ in range(reps):  # a new order each time: no path always runs on the caches another left
        for name in rng.permutation(names):
            times[str(name)].append(timers[str(name)]())
    round_trip = _timer(end_to_end)  # a phase of its own: it leaves the next path cold (see above)
    times["end_to_end"] = [round_trip() for _ in range(reps + 1)][1:]
    pre.free_pages(pages)
    dec.free_pages(dst_pages)
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    page_bytes = TOKEN_BYTES * page_tokens
    judged = goal is not None and page_bytes >= goal.from_page_bytes
    ratio = _paired_ratio(times, "baseline") if "baseline" in times else None
    fixed_us = None
    if "baseline" in times:
        fixed_us = (statistics.median(times["hybridkv"]) - statistics.median(times["baseline"])) * 1e6
    return {
        "page_bytes": page_bytes,
        "batch": batch,
        "bytes": nbytes,
        "ops": plan.num_ops,
        "hybridkv_gbps": gbps["hybridkv"],
        "baseline_gbps": gbps.get("baseline"),
        "ratio": ratio,
        "overhead_us": fixed_us,
        "plan_us": statistics.median(times["plan"]) * 1e6,
        "prepare_us": statistics.median(times["prepare"]) * 1e6,
        "unprepared_plan_us": statistics.median(times["unprepared_plan"]) * 1e6,
        "memcpy_block_gbps": gbps.get("memcpy_block"),
        "ratio_to_block": _paired_ratio(times, "memcpy_block") if "memcpy_block" in times else None,
        "end_to_end_gbps": gbps["end_to_end"],
        "goal": goal.ratio if goal is not None and judged else None,
        "meets_goal": ratio >= goal.ratio if goal is not None and ratio is not None and judged else None,
    }


def run(
    transport: str = "shm",
    page_tokens: tuple[int, ...] = (1, 4, 16, 64),
    batches: tuple[int, ...] = (16, 64, 256),
    reps: int = 7,
    max_request_bytes: int = 64 << 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Every (page size, batch) whose request fits ``max_request_bytes``."""
    rng = np.random.default_rng(seed)
    rows = []
    for tokens in page_tokens:
        fit = [b for b in batches if b * tokens * TOKEN_BYTES <= max_request_bytes]
        if not fit:
            continue
        with _ranks(transport, tokens, max(fit)) as (sender, receiver):
            rows += [_case(transport, sender, receiver, b, reps, rng) for b in fit]
    goal = transport_class(transport).bench_goal
    judged = [r for r in rows if r["meets_goal"] is not None]
    return {
        "transport": transport,
        "baseline": NO_BASELINE.format(transport) if goal is None else goal.baseline,
        "model": MODEL.name,
        "reps": reps,
        "goal": None if goal is None else _goal_text(goal),
        "meets_goal": all(r["meets_goal"] for r in judged) if judged else None,
        "cases": rows,
    }
