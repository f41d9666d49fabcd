"""``hybridkv bench pd``: disaggregated serving (``run_pd``) next to single-process serving, same requests, same run.

Workload: ``requests`` whole conversations of the Mooncake conversation trace scaled down
(``bench.engine.conversation_prompts``: shared prefixes), greedy, ``max_new_tokens`` each
(EOS does not stop either side), on one tiny random model saved to a temporary directory
that both sides load. Both serve with the same page size and chunk size and without a
prefix cache (``run_pd``'s prefill has none today).

Measured per request:
- **bytes**: what every decode TP rank's transfer report says it received, against what the
  spec says the request holds on that rank (``spec_bytes``: per pool of the rank's shard, the
  pages the pool's history rule keeps at the prompt's length, or its one state slot, times
  the pool's bytes per cell without alignment padding); their sums over the decode ranks.
- **transfer seconds**: the wall time during which some prefill stage was sending the request
  (the union of the stages' send windows), and the effective bandwidth: bytes of all decode
  ranks over it. ``PDRank`` has no send stamps yet, so a stage's send window is derived from
  the stamps it has: it opens when the stage finished computing the request and every decode
  rank had asked for it (a decode rank asks when it leaves the start barrier, then right after
  it finished decoding the previous request), and closes when the stage started its next
  request (it starts it as soon as its sender saw Success), or, for the last request, when
  every decode rank held it. ``handoff_s`` is ``RequestTiming.transfer_s`` (first token ->
  every decode rank holds the request: it includes waiting for a decode rank to be free).
- **overlap**: the part of each stage's send window during which another prefill stage was
  computing (any request), summed over stages, over the summed window lengths (0 when
  ``prefill_pp`` is 1).
- **TTFT**: arrival -> first token, both sides measured the same way with ``time.monotonic``.
  Every request arrives at the start: disaggregated, when prefill stage 0 leaves the start
  barrier, and its first token is the last stage's greedy choice (``RequestTiming.ttft_s``);
  single-process, when ``Engine.generate`` is called with all the requests (continuous
  batching, chunked prefill), and its first token is the engine's ``on_token`` call.
  ``ttft_ratio``: disaggregated over single-process. Neither side is warmed up.
- **exact**: the disaggregated tokens equal the single-process engine's.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.bench.engine import conversation_prompts
from hybridkv.engine.disagg import PDConfig, PDResult, run_pd
from hybridkv.engine.engine import Engine, engine_spec
from hybridkv.engine.random_models import quiet_transformers, save_random, tiny_names
from hybridkv.engine.registry import text_config
from hybridkv.engine.weights import read_config
from hybridkv.memory.layout import build_layouts
from hybridkv.spec import IdSpace, Parallel, ShardSpec

WIRED_TRANSPORTS = ("shm",)  # what run_pd moves KV/state over today
Interval = tuple[float, float]


def spec_bytes(model_dir: str, decode_tp: int, page_size: int, seq_len: int) -> list[int]:
    """Bytes a request of ``seq_len`` tokens holds on each decode TP rank, from the spec (see module doc)."""
    spec = engine_spec(text_config(read_config(model_dir)))
    out = []
    for rank in range(decode_tp):
        total = 0
        for layout in build_layouts(ShardSpec(spec, Parallel(tp_size=decode_tp), 0, rank), page_size):
            if layout.id_space is IdSpace.SLOT:
                cells = 1
            else:
                first, end = layout.pool_id.page_span(seq_len, page_size)
                cells = end - first
            total += cells * layout.data_bytes
        out.append(total)
    return out


def _length(iv: Interval) -> float:
    return max(0.0, iv[1] - iv[0])


def _covered(iv: Interval, others: Sequence[Interval]) -> float:
    """Seconds of ``iv`` that lie inside the union of ``others``."""
    covered, reach = 0.0, iv[0]
    for lo, hi in sorted(others):
        lo, hi = max(lo, reach), min(hi, iv[1])
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered


def _union(ivs: Sequence[Interval]) -> float:
    """Seconds covered by at least one of ``ivs``."""
    return _covered((min(iv[0] for iv in ivs), max(iv[1] for iv in ivs)), ivs)


@dataclass(frozen=True)
class StageWindows:
    """One prefill rank's part of one request: when it computed it and when its sender moved it."""

    stage: int  # PP stage
    compute: Interval
    send: Interval


@dataclass(frozen=True)
class Served:
    """One request as the disaggregated run served it (``time.monotonic`` stamps)."""

    arrival: float
    stages: tuple[StageWindows, ...]  # one per prefill rank
    decode_bytes: tuple[int, ...]  # per decode TP rank, as its transfer report says
    ttft_s: float
    handoff_s: float  # first token -> every decode rank holds the request


def served(result: PDResult) -> list[Served]:
    """Every request of ``result``, its send windows derived from the ranks' compute stamps (see module doc)."""
    stages = sorted((r for r in result.ranks if r.role == "prefill"), key=lambda r: r.index)
    decodes = sorted((r for r in result.ranks if r.role == "decode"), key=lambda r: r.index)
    arrival = stages[0].start
    n = len(result.timings)
    out = []
    for i, timing in enumerate(result.timings):
        asked = max(d.start if i == 0 else d.stamps[i - 1][1] for d in decodes)
        held = max(d.stamps[i][0] for d in decodes)
        windows = []
        for s in stages:
            lo = max(s.stamps[i][1], asked)
            hi = s.stamps[i + 1][0] if i + 1 < n else held
            windows.append(StageWindows(s.index, s.stamps[i], (lo, max(lo, hi))))
        decode_bytes = tuple(d.transfer_bytes[i] for d in decodes)
        out.append(Served(arrival, tuple(windows), decode_bytes, timing.ttft_s, timing.transfer_s))
    return out


def _request_row(req: Served, computing: Sequence[StageWindows], spec: list[int], ttft_single: float) -> dict[str, Any]:
    """The measured columns of one request; ``computing``: every prefill rank's windows of every request."""
    overlap = sum(_covered(w.send, [c.compute for c in computing if c.stage != w.stage]) for w in req.stages)
    send_s = sum(_length(w.send) for w in req.stages)
    transfer_s = _union([w.send for w in req.stages])
    moved = sum(req.decode_bytes)
    return {
        "transfer_bytes_per_rank": list(req.decode_bytes),
        "transfer_bytes": moved,
        "spec_bytes_per_rank": spec,
        "spec_bytes": sum(spec),
        "bytes_match": list(req.decode_bytes) == spec,
        "transfer_s": round(transfer_s, 6),
        "gbps": round(moved / transfer_s / 1e9, 6) if transfer_s > 0 else None,
        "handoff_s": round(req.handoff_s, 6),
        "send_s": round(send_s, 6),
        "overlap_s": round(overlap, 6),
        "overlap_ratio": round(overlap / send_s, 4) if send_s > 0 else 0.0,
        "stages": [
            {"stage": w.stage, "compute": _rel(w.compute, req.arrival), "send": _rel(w.send, req.arrival)}
            for w in req.stages
        ],
        "ttft_pd_s": round(req.ttft_s, 6),
        "ttft_single_s": round(ttft_single, 6),
        "ttft_ratio": round(req.ttft_s / ttft_single, 4),
    }


def _ttft_single(
    model_dir: str, prompts: list[list[int]], max_new: int, page_size: int, chunk: int
) -> tuple[list[float], list[list[int]]]:
    engine = Engine(model_dir, gpu_memory="64MiB", page_size=page_size, chunk_size=chunk, prefix_cache=False)
    first: dict[int, float] = {}

    def on_token(index: int, _token: int) -> None:
        first.setdefault(index, time.monotonic())

    arrival = time.monotonic()
    outs = engine.generate(prompts, max_new, stop_at_eos=False, on_token=on_token)
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"the single-process engine refused a request: {errors[0]}")
    return [first[i] - arrival for i in range(len(prompts))], [o.output_ids for o in outs]


def run(
    model: str = "tiny-qwen3-next",
    requests: int = 8,
    max_new_tokens: int = 8,
    transport: str = "shm",
    prefill_pp: int = 2,
    decode_tp: int = 2,
    block_tokens: int = 4,
    page_size: int = 16,
    chunk_size: int = 64,
) -> dict[str, Any]:
    if model not in tiny_names():
        raise ValueError(f"unknown model {model!r}; choose one of {tiny_names()}")
    if transport not in WIRED_TRANSPORTS:
        raise ValueError(
            f"transport {transport!r} is not wired into the disaggregated run yet (run_pd moves KV/state over "
            f"{', '.join(WIRED_TRANSPORTS)} only); use --transport shm"
        )
    prompts = conversation_prompts(requests, block_tokens)
    lengths = [len(p) for p in prompts]
    context = -(-(max(lengths) + max_new_tokens) // page_size) * page_size
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-pd-") as model_dir:
        save_random(model, model_dir)
        config = PDConfig(
            model_dir,
            tuple(map(tuple, prompts)),
            max_new_tokens,
            prefill_pp=prefill_pp,
            decode_tp=decode_tp,
            page_size=page_size,
            chunk=chunk_size,
            max_context=context,
        )
        result = run_pd(config)
        with quiet_transformers():
            ttft_single, single_ids = _ttft_single(model_dir, prompts, max_new_tokens, page_size, chunk_size)
        expected = [spec_bytes(model_dir, decode_tp, page_size, n) for n in lengths]
    requests_served = served(result)
    computing = [w for req in requests_served for w in req.stages]
    rows = [
        {"prompt_tokens": n}
        | _request_row(req, computing, spec, ttft)
        | {"exact": result.output_ids[i] == single_ids[i]}
        for i, (n, req, spec, ttft) in enumerate(zip(lengths, requests_served, expected, ttft_single, strict=True))
    ]
    total_bytes = sum(r["transfer_bytes"] for r in rows)
    total_s = sum(r["transfer_s"] for r in rows)
    send_total = sum(r["send_s"] for r in rows)
    ttft_pd = sum(r["ttft_pd_s"] for r in rows) / requests
    ttft_one = sum(r["ttft_single_s"] for r in rows) / requests
    return {
        "model": model,
        "transport": transport,
        "prefill_pp": prefill_pp,
        "decode_tp": decode_tp,
        "requests": requests,
        "max_new_tokens": max_new_tokens,
        "block_tokens": block_tokens,
        "page_size": page_size,
        "chunk_size": chunk_size,
        "prefix_cache": False,
        "send_windows": "derived from compute stamps (PDRank has no send stamps)",
        "prompt_tokens": {"min": min(lengths), "mean": round(sum(lengths) / requests, 1), "max": max(lengths)},
        "per_request": rows,
        "totals": {
            "transfer_bytes": total_bytes,
            "spec_bytes": sum(r["spec_bytes"] for r in rows),
            "bytes_match": all(r["bytes_match"] for r in rows),
            "transfer_s": round(total_s, 6),
            "gbps": round(total_bytes / total_s / 1e9, 6) if total_s > 0 else None,
            "overlap_ratio": round(sum(r["overlap_s"] for r in rows) / send_total, 4) if send_total > 0 else 0.0,
            "ttft_pd_mean_s": round(ttft_pd, 6),
            "ttft_single_mean_s": round(ttft_one, 6),
            "ttft_ratio": round(ttft_pd / ttft_one, 4),
            "exact": sum(r["exact"] for r in rows),
        },
    }


def _rel(iv: Interval, origin: float) -> list[float]:
    return [round(iv[0] - origin, 6), round(iv[1] - origin, 6)]
