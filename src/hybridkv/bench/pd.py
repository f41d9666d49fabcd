"""``hybridkv bench pd``: disaggregated serving (``run_pd``) next to single-process serving, same requests, same run.

Workload: ``requests`` whole conversations of the Mooncake conversation trace scaled down
(``bench.engine.conversation_prompts``: shared prefixes), greedy, ``max_new_tokens`` each
(EOS does not stop either side), on one tiny random model saved to a temporary directory
that both sides load; the prefill processes and the single process run one torch thread each.
Both serve with the same page size, chunk size and prefix-cache setting
(disaggregated: the prefill engine's cache; single-process: the engine's).

Measured per request (the disaggregated side from its ``Outcome``'s ``PDPath``: its ``StageTiming`` per
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
- **TTFT**: arrival -> first token, both sides measured the same way with ``time.monotonic``,
  after both served ``WARM_UP`` (not measured). Burst: every request arrives at once
  (disaggregated: all submitted to the server; the first token is chosen on the prefill engine,
  ``RequestTiming.ttft_s``; single-process: ``Engine.generate`` with all of them, the first token
  is its ``on_token`` call). ``ttft_extra_ms``: disaggregated minus single-process mean; the goal
  (``ttft_goal_met``): at most the mean handoff (first token -> every decode rank holds the KV)
  + ``TTFT_MARGIN_S``. Alone: each request again, one at a time, after the burst (both caches hold
  its prompt: the TTFT is the control path's cost), ``alone_ttft_extra_ms``.
- **prefill throughput**: a burst of the same prompts asking one new token each (prefill only: the
  decode side does not compete for the CPU), on a fresh engine and cache: prompt tokens computed
  (not served from the cache) over the last first token, both sides; ``prefill_throughput_ratio``
  disaggregated over single-process (goal >= 0.8).
- **exact**: the disaggregated tokens equal the single-process engine's.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.bench.engine import conversation_prompts
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.disagg import FINISHED, PDConfig, PDResult, PDServer, pd_path
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import CONTEXT, quiet_transformers, save_random, tiny_names
from hybridkv.engine.registry import engine_spec, text_config
from hybridkv.engine.sched.request import Outcome, SamplingParams
from hybridkv.engine.weights import read_config
from hybridkv.memory.layout import build_layouts
from hybridkv.spec import IdSpace, Parallel, ShardSpec

Interval = tuple[float, float]
TTFT_MARGIN_S = 0.010
"""The goal: disaggregated mean TTFT at most the single process's + the mean handoff + this."""


def spec_bytes(
    model_dir: str, decode_tp: int, page_size: int, seq_len: int, dtype: torch.dtype = torch.float32
) -> list[int]:
    """Bytes a request of ``seq_len`` tokens holds on each decode TP rank, from the spec in ``dtype`` (see module
    doc)."""
    spec = engine_spec(text_config(read_config(model_dir)), dtype)
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
    req: Outcome, computing: Sequence[tuple[int, Interval]], spec: list[int], ttft_single: float, origin: float
) -> dict[str, Any]:
    """The measured columns of one finished request; ``computing``: (PP stage, compute interval) of every
    prefill rank and request; stamps in the report are seconds since ``origin``."""
    path = pd_path(req)
    if path.timing is None:
        raise RuntimeError(f"request {req.rid} {path.status}: {req.error or ''}")
    sends = [st.send for st in path.stages]
    overlap = sum(_covered(st.send, [c for _, c in computing]) for st in path.stages)
    other = sum(_covered(st.send, [c for pp, c in computing if pp != st.pp]) for st in path.stages)
    send_s = sum(map(_length, sends))
    ops = sum(st.ops for st in path.stages)
    transfer_s = _union(sends)
    moved = sum(path.decode_bytes)
    return {
        "cached_tokens_pd": req.cached_tokens,
        "transfer_bytes_per_rank": list(path.decode_bytes),
        "transfer_bytes": moved,
        "spec_bytes_per_rank": spec,
        "spec_bytes": sum(spec),
        "bytes_match": list(path.decode_bytes) == spec,
        "transfer_s": round(transfer_s, 6),
        "gbps": round(moved / transfer_s / 1e9, 6) if transfer_s > 0 else None,
        "handoff_s": round(path.timing.transfer_s, 6),
        "send_s": round(send_s, 6),
        "ops": ops,
        "send_us_per_op": round(send_s * 1e6 / ops, 2) if ops else None,
        "overlap_s": round(overlap, 6),
        "overlap_ratio": _ratio(overlap, send_s),
        "overlap_other_stage_s": round(other, 6),
        "overlap_other_stage_ratio": _ratio(other, send_s),
        "stages": [
            {"pp": st.pp, "tp": st.tp, "compute": _rel(st.compute, origin), "send": _rel(st.send, origin)}
            for st in path.stages
        ],
        "ttft_pd_s": round(path.timing.ttft_s, 6),
        "ttft_single_s": round(ttft_single, 6),
        "ttft_ratio": round(path.timing.ttft_s / ttft_single, 4),
    }


WARM_UP = ((5, 6, 7, 8), (9, 10, 11))
"""Prompts both sides serve first, outside the measures (first-call allocations, the transfer handshake)."""


@dataclass
class _Side:
    """One side's measures: per request of the burst its TTFT, tokens and hit; per request served alone its TTFT
    and hit; when the burst's last first token came (seconds after arrival)."""

    ttft: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    alone_ttft: list[float] = field(default_factory=list)
    alone_cached: list[int] = field(default_factory=list)
    prefill_tokens_per_s: float = 0.0
    """Prompt tokens computed per second, a burst of prefill-only requests (one new token each) on a fresh
    engine: what the prefill engine can do without the decode side competing for the CPU."""


def _throughput(prompts: list[list[int]], cached: list[int], ttft: list[float]) -> float:
    return (sum(map(len, prompts)) - sum(cached)) / max(ttft)


def pd_prompts(requests: int, block_tokens: int, max_new_tokens: int) -> list[list[int]]:
    """Every prompt the benchmark serves (``WARM_UP`` first, then the measured ones): what it is sized for."""
    measured = conversation_prompts(requests, block_tokens, max_tokens=CONTEXT - max_new_tokens)
    return [list(p) for p in WARM_UP] + measured


def _single_process(model_dir: str, prompts: list[list[int]], params: SamplingParams, config: PDConfig) -> _Side:
    """The single-process engine on the same requests, sized as each disaggregated process: a prefill-only burst
    (its throughput), then on a fresh cache a burst (all at once), then each again alone."""
    engine = Engine(model_dir, config=config.engine)
    engine.generate([list(p) for p in WARM_UP], 2)
    first: dict[int, float] = {}

    def on_token(index: int, _token: int) -> None:
        first.setdefault(index, time.monotonic())

    def burst(each: SamplingParams) -> tuple[list[Outcome], list[float]]:
        engine.clear_cache()
        first.clear()
        arrival = time.monotonic()
        outs = engine.generate(prompts, [each] * len(prompts), on_token=on_token)
        errors = [o.error for o in outs if o.error is not None]
        if errors:
            raise RuntimeError(f"the single-process engine refused a request: {errors[0]}")
        return outs, [first[i] - arrival for i in range(len(prompts))]

    side = _Side()
    outs, ttft = burst(SamplingParams(1, ignore_eos=True))
    side.prefill_tokens_per_s = _throughput(prompts, [o.cached_tokens for o in outs], ttft)
    outs, side.ttft = burst(params)
    side.tokens = [o.output_ids for o in outs]
    side.cached = [o.cached_tokens for o in outs]
    for ids in prompts:
        first.clear()
        start = time.monotonic()
        (out,) = engine.generate([ids], [params], on_token=on_token)
        side.alone_ttft.append(first[0] - start)
        side.alone_cached.append(out.cached_tokens)
    return side


def _disaggregated(config: PDConfig, prompts: list[list[int]], params: SamplingParams) -> tuple[_Side, PDResult]:
    """The same on disaggregated servers (a fresh one after the prefill-only burst: its prefix cache is
    empty again); the burst's ``Outcome``s for the per-request rows."""
    side = _Side()
    with PDServer(config) as server:
        for p in WARM_UP:
            server.result(server.submit(p, SamplingParams(2)))
        only = [server.result(h) for h in [server.submit(p, SamplingParams(1, ignore_eos=True)) for p in prompts]]
    ttft = [t.ttft_s for t in (pd_path(r).timing for r in only) if t is not None]
    if len(ttft) < len(only):
        raise RuntimeError(f"a prefill-only request failed disaggregated: {[r.error for r in only if r.error]}")
    side.prefill_tokens_per_s = _throughput(prompts, [r.cached_tokens for r in only], ttft)
    with PDServer(config) as server:
        for p in WARM_UP:
            server.result(server.submit(p, SamplingParams(2)))
        burst = [server.result(h) for h in [server.submit(p, params) for p in prompts]]
        failed = [r for r in burst if pd_path(r).status != FINISHED]
        if failed:
            raise RuntimeError(
                f"{len(failed)} requests failed disaggregated; request {failed[0].rid}: {failed[0].error}"
            )
        for ids in prompts:
            alone = server.result(server.submit(ids, params))
            timing = pd_path(alone).timing
            if timing is None:
                raise RuntimeError(f"a request served alone failed disaggregated: {alone.error}")
            side.alone_ttft.append(timing.ttft_s)
            side.alone_cached.append(alone.cached_tokens)
    timings = [pd_path(r).timing for r in burst]
    side.ttft = [t.ttft_s for t in timings if t is not None]
    side.tokens = [r.output_ids for r in burst]
    side.cached = [r.cached_tokens for r in burst]
    result = PDResult(side.tokens, server.ranks, timings, burst, server.deaths, [], [])
    return side, result


def run(
    model: str = "tiny-qwen3-next",
    requests: int = 16,
    max_new_tokens: int = 8,
    transport: str = "shm",
    prefill_pp: int = 2,
    prefill_tp: int = 1,
    decode_tp: int = 2,
    block_tokens: int = 4,
    page_size: int = 16,
    chunk_size: int = 64,
    prefix_cache: bool = True,
    *,
    gpu_memory: int,
    max_context: int,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Serve the same requests disaggregated and in one process; the report's keys are the module doc's measures.
    ``gpu_memory`` (per process, both sides) and ``max_context``: the command's sizing (``cli/sizing.py``) for the
    prompts of ``pd_prompts``."""
    if model not in tiny_names():
        raise ValueError(f"unknown model {model!r}; choose one of {tiny_names()}")
    prompts = pd_prompts(requests, block_tokens, max_new_tokens)[len(WARM_UP) :]
    lengths = [len(p) for p in prompts]
    params = SamplingParams(max_new_tokens, ignore_eos=True)  # both sides compute every token
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-pd-") as model_dir:
        save_random(model, model_dir)
        config = PDConfig(
            model_dir,
            prefill_pp=prefill_pp,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            transport=transport,
            engine=EngineConfig(
                gpu_memory=gpu_memory,
                page_size=page_size,
                chunk_size=chunk_size,
                max_context=max_context,
                dtype=getattr(torch, dtype),
                prefix_cache=prefix_cache,
            ),
        )
        pd, result = _disaggregated(config, prompts, params)
        with quiet_transformers():
            single = _single_process(model_dir, prompts, params, config)
        expected = [spec_bytes(model_dir, decode_tp, page_size, n, config.engine.dtype) for n in lengths]
    computing = [(st.pp, st.compute) for req in result.requests for st in pd_path(req).stages]
    origin = min(c[0] for _, c in computing)
    rows = [
        {"prompt_tokens": lengths[i], "cached_tokens_single": single.cached[i]}
        | request_row(req, computing, expected[i], single.ttft[i], origin)
        | {
            "exact": req.output_ids == single.tokens[i],
            "alone_ttft_pd_s": round(pd.alone_ttft[i], 6),
            "alone_ttft_single_s": round(single.alone_ttft[i], 6),
            "alone_cached_tokens_pd": pd.alone_cached[i],
            "alone_cached_tokens_single": single.alone_cached[i],
        }
        for i, req in enumerate(result.requests)
    ]
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
        "dtype": dtype,
        "prompt_tokens": {"min": min(lengths), "mean": round(sum(lengths) / requests, 1), "max": max(lengths)},
        "per_request": rows,
        "totals": _totals(rows, pd, single),
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _totals(rows: list[dict[str, Any]], pd: _Side, single: _Side) -> dict[str, Any]:
    total_bytes = sum(r["transfer_bytes"] for r in rows)
    total_s = sum(r["transfer_s"] for r in rows)
    send_total = sum(r["send_s"] for r in rows)
    ops_total = sum(r["ops"] for r in rows)
    ttft_pd, ttft_one = _mean(pd.ttft), _mean(single.ttft)
    handoff = _mean([r["handoff_s"] for r in rows])
    throughput_pd, throughput_one = pd.prefill_tokens_per_s, single.prefill_tokens_per_s
    alone_pd, alone_one = _mean(pd.alone_ttft), _mean(single.alone_ttft)
    return {
        "transfer_bytes": total_bytes,
        "spec_bytes": sum(r["spec_bytes"] for r in rows),
        "bytes_match": all(r["bytes_match"] for r in rows),
        "transfer_s": round(total_s, 6),
        "gbps": round(total_bytes / total_s / 1e9, 6) if total_s > 0 else None,
        "ops": ops_total,
        "send_us_per_op": round(send_total * 1e6 / ops_total, 2) if ops_total else None,
        "overlap_ratio": _ratio(sum(r["overlap_s"] for r in rows), send_total),
        "overlap_other_stage_ratio": _ratio(sum(r["overlap_other_stage_s"] for r in rows), send_total),
        "cached_tokens_pd": sum(pd.cached) + sum(pd.alone_cached),
        "cached_tokens_single": sum(single.cached) + sum(single.alone_cached),
        "ttft_pd_mean_s": round(ttft_pd, 6),
        "ttft_single_mean_s": round(ttft_one, 6),
        "ttft_ratio": round(ttft_pd / ttft_one, 4),
        "ttft_extra_ms": round((ttft_pd - ttft_one) * 1e3, 3),
        "handoff_mean_ms": round(handoff * 1e3, 3),
        "ttft_goal_met": ttft_pd - ttft_one <= handoff + TTFT_MARGIN_S,
        "prefill_tokens_per_s_pd": round(throughput_pd, 1),
        "prefill_tokens_per_s_single": round(throughput_one, 1),
        "prefill_throughput_ratio": round(throughput_pd / throughput_one, 4),
        "alone_ttft_pd_mean_s": round(alone_pd, 6),
        "alone_ttft_single_mean_s": round(alone_one, 6),
        "alone_ttft_extra_ms": round((alone_pd - alone_one) * 1e3, 3),
        "exact": sum(r["exact"] for r in rows),
    }
