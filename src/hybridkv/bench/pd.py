"""``hybridkv bench pd``: disaggregated serving (``run_pd``) next to single-process serving, same requests, same run.

Workload: ``requests`` whole conversations of the Mooncake conversation trace scaled down
(``bench.engine.conversation_prompts``: shared prefixes), greedy, ``max_new_tokens`` each
(EOS does not stop either side), on one tiny random model saved to a temporary directory
that both sides load. Both serve with the same page size, chunk size and prefix-cache setting
(disaggregated: the prefill engine's cache; single-process: the engine's).

Measured per request (the disaggregated side from ``RequestResult``: its ``StageTiming`` per
prefill rank and its bytes per decode rank):
- **bytes**: what every decode TP rank received, against what the spec says the request holds
  on that rank (``spec_bytes``: per pool of the rank's shard, the pages the pool's history rule
  keeps at the prompt's length, or its one state slot, times the pool's bytes per cell without
  alignment padding); their sums over the decode ranks. A prefill prefix-cache hit does not
  change them: decode always gets the whole request.
- **transfer seconds**: the wall time during which some prefill rank was sending the request
  (the union of the ranks' send windows: handed to its sender -> the sender finished every
  decode rank's leg), and the effective bandwidth: bytes of all decode ranks over it.
  ``handoff_s`` is ``RequestTiming.transfer_s`` (first token -> every decode rank holds it).
- **ops**: the write ops the prefill ranks submitted (one per contiguous run of source and
  destination), and ``send_us_per_op``: summed send windows over them. Over Mooncake TCP the
  send time grows with the ops, not the bytes (each op is its own transfer), and a decode TP
  size above the prefill one slices every token of a page into its own op.
- **overlap**: the part of each prefill rank's send window during which the prefill engine was
  computing (some prefill rank inside the compute interval of some request), summed over ranks,
  over the summed window lengths: the transfer time hidden behind prefill compute. Senders run
  beside compute, so stage ``s`` sends a request while stage ``s + 1`` still computes it and
  while stage ``s`` computes the next request. ``overlap_other_stage_ratio`` counts only other
  PP stages' compute (0 when ``prefill_pp`` is 1). A rank's compute interval runs from when it
  took the request (stage ``s > 0`` then waits for stage ``s - 1``'s hidden states) to its last
  chunk, so with ``prefill_pp > 1`` a stage's interval includes that wait.
- **TTFT**: arrival -> first token, both sides measured the same way with ``time.monotonic``.
  Every request arrives at the start: disaggregated, all are submitted to the server at once
  and the first token is prefill's greedy pick (``RequestTiming.ttft_s``); single-process,
  ``Engine.generate`` is called with all of them (continuous batching, chunked prefill) and
  the first token is the engine's ``on_token`` call. ``ttft_ratio``: disaggregated over
  single-process. Neither side is warmed up.
- **exact**: the disaggregated tokens equal the single-process engine's.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from typing import Any

from hybridkv.bench.engine import conversation_prompts
from hybridkv.engine.disagg import FINISHED, PDConfig, RequestResult, run_pd
from hybridkv.engine.engine import Engine, engine_spec
from hybridkv.engine.random_models import CONTEXT, quiet_transformers, save_random, tiny_names
from hybridkv.engine.registry import text_config
from hybridkv.engine.weights import read_config
from hybridkv.memory.layout import build_layouts
from hybridkv.spec import IdSpace, Parallel, ShardSpec

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


def _ratio(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole > 0 else 0.0


def _rel(iv: Interval, origin: float) -> list[float]:
    return [round(iv[0] - origin, 6), round(iv[1] - origin, 6)]


def request_row(
    req: RequestResult, computing: Sequence[tuple[int, Interval]], spec: list[int], ttft_single: float, origin: float
) -> dict[str, Any]:
    """The measured columns of one finished request; ``computing``: (PP stage, compute interval) of every
    prefill rank and request; stamps in the report are seconds since ``origin``."""
    if req.timing is None:
        raise RuntimeError(f"request {req.index} {req.status}: {req.reason}")
    sends = [st.send for st in req.stages]
    overlap = sum(_covered(st.send, [c for _, c in computing]) for st in req.stages)
    other = sum(_covered(st.send, [c for pp, c in computing if pp != st.pp]) for st in req.stages)
    send_s = sum(map(_length, sends))
    ops = sum(st.ops for st in req.stages)
    transfer_s = _union(sends)
    moved = sum(req.decode_bytes)
    return {
        "cached_tokens_pd": req.cached_tokens,
        "transfer_bytes_per_rank": list(req.decode_bytes),
        "transfer_bytes": moved,
        "spec_bytes_per_rank": spec,
        "spec_bytes": sum(spec),
        "bytes_match": list(req.decode_bytes) == spec,
        "transfer_s": round(transfer_s, 6),
        "gbps": round(moved / transfer_s / 1e9, 6) if transfer_s > 0 else None,
        "handoff_s": round(req.timing.transfer_s, 6),
        "send_s": round(send_s, 6),
        "ops": ops,
        "send_us_per_op": round(send_s * 1e6 / ops, 2) if ops else None,
        "overlap_s": round(overlap, 6),
        "overlap_ratio": _ratio(overlap, send_s),
        "overlap_other_stage_s": round(other, 6),
        "overlap_other_stage_ratio": _ratio(other, send_s),
        "stages": [
            {"pp": st.pp, "tp": st.tp, "compute": _rel(st.compute, origin), "send": _rel(st.send, origin)}
            for st in req.stages
        ],
        "ttft_pd_s": round(req.timing.ttft_s, 6),
        "ttft_single_s": round(ttft_single, 6),
        "ttft_ratio": round(req.timing.ttft_s / ttft_single, 4),
    }


def _single_process(
    model_dir: str, prompts: list[list[int]], max_new: int, page_size: int, chunk: int, prefix_cache: bool
) -> tuple[list[float], list[list[int]], list[int]]:
    """Per request: TTFT, tokens and prefix-cache hit of the single-process engine serving every prompt at once."""
    engine = Engine(model_dir, gpu_memory="64MiB", page_size=page_size, chunk_size=chunk, prefix_cache=prefix_cache)
    first: dict[int, float] = {}

    def on_token(index: int, _token: int) -> None:
        first.setdefault(index, time.monotonic())

    arrival = time.monotonic()
    outs = engine.generate(prompts, max_new, stop_at_eos=False, on_token=on_token)
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"the single-process engine refused a request: {errors[0]}")
    return (
        [first[i] - arrival for i in range(len(prompts))],
        [o.output_ids for o in outs],
        [o.cached_tokens for o in outs],
    )


def run(
    model: str = "tiny-qwen3-next",
    requests: int = 8,
    max_new_tokens: int = 8,
    transport: str = "shm",
    prefill_pp: int = 2,
    prefill_tp: int = 1,
    decode_tp: int = 2,
    block_tokens: int = 4,
    page_size: int = 16,
    chunk_size: int = 64,
    prefix_cache: bool = True,
) -> dict[str, Any]:
    """Serve the same requests disaggregated and in one process; the report's keys are the module doc's measures."""
    if model not in tiny_names():
        raise ValueError(f"unknown model {model!r}; choose one of {tiny_names()}")
    prompts = conversation_prompts(requests, block_tokens, max_tokens=CONTEXT - max_new_tokens)
    lengths = [len(p) for p in prompts]
    context = -(-(max(lengths) + max_new_tokens) // page_size) * page_size
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-pd-") as model_dir:
        save_random(model, model_dir)
        config = PDConfig(
            model_dir,
            tuple(map(tuple, prompts)),
            max_new_tokens,
            prefill_pp=prefill_pp,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            transport=transport,
            page_size=page_size,
            chunk=chunk_size,
            max_context=context,
            prefix_cache=prefix_cache,
        )
        result = run_pd(config)
        failed = [r for r in result.requests if r.status != FINISHED]
        if failed:
            raise RuntimeError(
                f"{len(failed)} requests failed disaggregated; request {failed[0].index}: {failed[0].reason}"
            )
        with quiet_transformers():
            ttft_single, single_ids, single_cached = _single_process(
                model_dir, prompts, max_new_tokens, page_size, chunk_size, prefix_cache
            )
        expected = [spec_bytes(model_dir, decode_tp, page_size, n) for n in lengths]
    computing = [(st.pp, st.compute) for req in result.requests for st in req.stages]
    origin = min(c[0] for _, c in computing)
    rows = [
        {"prompt_tokens": lengths[i], "cached_tokens_single": single_cached[i]}
        | request_row(req, computing, expected[i], ttft_single[i], origin)
        | {"exact": req.output_ids == single_ids[i]}
        for i, req in enumerate(result.requests)
    ]
    total_bytes = sum(r["transfer_bytes"] for r in rows)
    total_s = sum(r["transfer_s"] for r in rows)
    send_total = sum(r["send_s"] for r in rows)
    ops_total = sum(r["ops"] for r in rows)
    ttft_pd = sum(r["ttft_pd_s"] for r in rows) / requests
    ttft_one = sum(r["ttft_single_s"] for r in rows) / requests
    return {
        "model": model,
        "transport": transport,
        "prefill_pp": prefill_pp,
        "prefill_tp": prefill_tp,
        "decode_tp": decode_tp,
        "requests": requests,
        "max_new_tokens": max_new_tokens,
        "block_tokens": block_tokens,
        "page_size": page_size,
        "chunk_size": chunk_size,
        "prefix_cache": prefix_cache,
        "prompt_tokens": {"min": min(lengths), "mean": round(sum(lengths) / requests, 1), "max": max(lengths)},
        "per_request": rows,
        "totals": {
            "transfer_bytes": total_bytes,
            "spec_bytes": sum(r["spec_bytes"] for r in rows),
            "bytes_match": all(r["bytes_match"] for r in rows),
            "transfer_s": round(total_s, 6),
            "gbps": round(total_bytes / total_s / 1e9, 6) if total_s > 0 else None,
            "ops": ops_total,
            "send_us_per_op": round(send_total * 1e6 / ops_total, 2) if ops_total else None,
            "overlap_ratio": _ratio(sum(r["overlap_s"] for r in rows), send_total),
            "overlap_other_stage_ratio": _ratio(sum(r["overlap_other_stage_s"] for r in rows), send_total),
            "cached_tokens_pd": sum(r["cached_tokens_pd"] for r in rows),
            "cached_tokens_single": sum(single_cached),
            "ttft_pd_mean_s": round(ttft_pd, 6),
            "ttft_single_mean_s": round(ttft_one, 6),
            "ttft_ratio": round(ttft_pd / ttft_one, 4),
            "exact": sum(r["exact"] for r in rows),
        },
    }
