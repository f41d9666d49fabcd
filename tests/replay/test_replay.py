"""Replays of real traces through memory + cache: the unbounded hit rate equals an
independently computed upper bound; hybrid rules never exceed full-only; under pressure
every request is served, nothing leaks, and the cache cap holds."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest

from hybridkv.memory import LayoutError
from hybridkv.replay import (
    EngineModel,
    ReplayConfig,
    ReplayError,
    ReplayRequest,
    Simulator,
    Workload,
    build_report,
    load_workload,
)
from hybridkv.replay.workload import OUTPUT_BASE
from hybridkv.traces import MOONCAKE_TRACE, PEER_TRACE, load_mooncake_trace


def upper_bound(workload: Workload, page_size: int) -> tuple[int, int]:
    """Sequential prefix reuse: each request against every earlier prompt, page-aligned,
    at most input - 1 tokens (one token is always computed). A set of page-prefix digests
    (each prefix named by the SHA-1 chain of its pages)."""
    seen: set[bytes] = set()
    hit = total = 0
    for r in workload.requests:
        toks, ps = r.input_ids(), page_size
        digests, h = [], hashlib.sha1()
        for e in range(toks.size // ps):
            h.update(toks[e * ps : (e + 1) * ps].tobytes())
            digests.append(h.copy().digest())
        k = 0
        while k < (toks.size - 1) // ps and digests[k] in seen:
            k += 1
        hit += k * ps
        total += toks.size
        seen.update(digests)
    return hit, total


@pytest.fixture(scope="module")
def mooncake() -> Workload:
    return load_workload(MOONCAKE_TRACE, limit=60)


def test_mooncake_tokens_follow_the_trace(mooncake):
    r = mooncake.requests[0]
    tokens, output = r.input_ids(), r.output_ids()
    assert tokens[0] == 0 * 512 and tokens.size == r.input_length
    assert (output >= OUTPUT_BASE).all() and output.size == r.output_length
    assert [x.arrival_s for x in mooncake.requests] == sorted(x.arrival_s for x in mooncake.requests)


def test_mooncake_ids_are_made_per_request_not_kept(mooncake):
    """A workload keeps block ids and lengths only; the ids are built on demand, equal to the
    trace's expansion every time; the simulator holds them only for running requests."""
    rows = load_mooncake_trace(MOONCAKE_TRACE, limit=60)
    by_time = sorted(rows, key=lambda row: row.timestamp_ms)
    for r, row in zip(mooncake.requests, by_time, strict=True):
        assert r.prompt is None and r.generated is None and r.blocks is not None
        assert r.blocks.nbytes <= 8 * len(row.hash_ids)
        assert np.array_equal(r.input_ids(), row.input_tokens()) and np.array_equal(r.input_ids(), r.input_ids())
    kept = sum(r.blocks.nbytes for r in mooncake.requests)
    assert kept * 100 < 8 * mooncake.input_tokens  # block ids, not tokens
    built: list[int] = []

    class Counting(Simulator):
        def _prefill(self, req):
            got = super()._prefill(req)
            if got is not None:
                built.append(got[0].tokens.size)
            return got

    Counting(mooncake, ReplayConfig("Llama-3.1-8B", "110GiB", page_size=16)).run()
    assert sorted(built) == sorted(r.input_length for r in mooncake.requests)


def test_unbounded_hit_rate_equals_the_trace_upper_bound(mooncake):
    hit, total = upper_bound(mooncake, 16)
    assert hit > 0
    sim = Simulator(mooncake, ReplayConfig("Llama-3.1-8B", "110GiB", page_size=16))
    res = sim.run()
    assert (res.input_tokens, res.hit_tokens) == (total, hit)
    assert res.full_hit_tokens == hit and res.requests == len(mooncake.requests)
    assert res.cache["evicted_pages"] == 0 and res.retractions == 0
    sim.verify()


@pytest.mark.parametrize(
    ("model", "memory", "loses"), [("Gemma-3-27B-IT", "420GiB", False), ("Qwen3-Next-80B-A3B-Instruct", "60GiB", True)]
)
def test_hybrid_rules_cost_hits_but_never_exceed_full_only(mooncake, model, memory, loses):
    hit, _ = upper_bound(mooncake, 16)
    sim = Simulator(mooncake, ReplayConfig(model, memory, page_size=16))
    report = build_report(sim.run())
    rate = report["hit_rate_by_component"]
    inputs = report["input_tokens"]
    assert round(rate["full_only"] * inputs) == hit  # unbounded: the full-KV match is the bound
    assert rate["all"] <= min(rate["full+swa"], rate["full+state"]) <= rate["full_only"]
    if loses:  # the first sharer of a prefix leaves no checkpoint where the next one's match ends
        assert 0 < rate["all"] < rate["full_only"]
    else:  # window pages that left a window stay window-cached: with room for them, no hit is lost
        assert rate["all"] == rate["full_only"] > 0
    windows = {k for k in rate if k.startswith("full+swa:")}  # each window pool alone
    assert windows == ({"full+swa:1024"} if model.startswith("Gemma") else set())
    assert all(rate[k] == rate["full+swa"] for k in windows)  # one window: the same rule
    assert report["validity_cost"]["all"] == pytest.approx(rate["full_only"] - rate["all"])
    sim.verify()


def synthetic(n: int = 40, seed: int = 0) -> Workload:
    """Requests sharing a few system prompts, 40-200 tokens, arriving 10 per second."""
    rng = np.random.default_rng(seed)
    prompts = [np.arange(k * 1000, k * 1000 + 48) for k in range(3)]
    reqs = []
    for rid in range(n):
        tail = rng.integers(10_000, 10_100, size=int(rng.integers(1, 150)))
        tokens = np.concatenate([prompts[rid % 3], tail])
        output = OUTPUT_BASE + rid * 1000 + np.arange(int(rng.integers(1, 60)))
        reqs.append(ReplayRequest.from_ids(rid, rid / 10, tokens, output))
    return Workload("synthetic", tuple(reqs))


@pytest.mark.parametrize(
    ("model", "memory", "policy"),
    [("tiny-swa2-state", 700_000, "lru"), ("tiny-gdn", 450_000, "cost"), ("tiny-swa", 700_000, "lfu")],
)
def test_under_pressure_every_request_is_served_and_nothing_leaks(model, memory, policy):
    workload = synthetic()
    engine = EngineModel(max_running=8, decode_chunk=4, chunk_tokens=32)
    sim = Simulator(workload, ReplayConfig(model, memory, page_size=4, policy=policy, engine=engine, verify_every=1))
    res = sim.run()
    assert res.requests == len(workload.requests)
    outputs = sum(r.output_length for r in workload.requests)
    assert res.decode_tokens == outputs if not res.retractions else res.decode_tokens > outputs
    stats = res.cache
    assert stats["evicted_pages"] > 0 and stats["open_locks"] == 0
    assert sim.mem.pages.live_count == sim.cache.cached_pages, "a page outlived its request"
    assert sim.mem.slots.live_count == sim.cache.num_checkpoints, "a state slot outlived its request"
    rate = build_report(res, with_timeline=False)["hit_rate_by_component"]
    each = [v for k, v in rate.items() if k.startswith("full+swa:")]  # each window pool alone
    assert len(each) == len(sim.cache.rules.windows) and all(rate["full+swa"] <= v <= rate["full_only"] for v in each)
    sim.verify()


@pytest.mark.parametrize(("model", "absent"), [("tiny-swa", "state"), ("tiny-gdn", "swa")])
def test_a_rule_the_model_does_not_have_costs_no_hits(model, absent):
    """Under pressure (windows tombstoned, checkpoints evicted), a component the model does
    not have must not be charged for the other component's losses."""
    engine = EngineModel(max_running=8, decode_chunk=4, chunk_tokens=32)
    report = build_report(Simulator(synthetic(), ReplayConfig(model, 450_000, page_size=4, engine=engine)).run())
    rate = report["hit_rate_by_component"]
    present = "swa" if absent == "state" else "state"
    assert report["validity_cost"][absent] == 0.0 and rate[f"full+{absent}"] == rate["full_only"]
    assert report["validity_cost"][present] > 0  # the model's own rule did cost hits here
    assert rate["all"] == rate[f"full+{present}"]


def test_retraction_when_decode_cannot_grow():
    workload = synthetic(n=24, seed=3)
    engine = EngineModel(max_running=24, decode_chunk=8, prefill_tokens_per_s=1e9, chunk_tokens=32)
    sim = Simulator(workload, ReplayConfig("tiny-swa2-state", 700_000, page_size=4, engine=engine, verify_every=1))
    res = sim.run()
    assert res.retractions > 0 and res.requests == 24
    assert res.decode_tokens >= sum(r.output_length for r in workload.requests)
    sim.verify()


def test_cache_token_cap_holds_once_requests_release_their_hits():
    cap = 200
    sim = Simulator(synthetic(), ReplayConfig("tiny-dense", 8_000_000, page_size=4, cache_tokens=cap))
    res = sim.run()
    idle = [s["cached_tokens"] for s in res.timeline if s["running"] == 0]
    assert idle and max(idle) <= cap and sim.cache.cached_tokens <= cap
    assert res.cache["evicted_pages"] > 0
    uncapped = Simulator(synthetic(), ReplayConfig("tiny-dense", 8_000_000, page_size=4)).run()
    assert uncapped.cache["cached_tokens"] > cap and uncapped.cache["evicted_pages"] == 0


def test_a_memory_too_small_for_one_request_or_an_empty_trace_is_a_clear_error():
    big = ReplayRequest.from_ids(0, 0.0, np.arange(4000), OUTPUT_BASE + np.arange(10))
    with pytest.raises(LayoutError, match="Raise the budget to at least"):
        Simulator(Workload("one", (big,)), ReplayConfig("tiny-dense", 100_000, page_size=4))
    with pytest.raises(ReplayError, match="no requests"):
        Simulator(Workload("none", ()), ReplayConfig("tiny-dense", 100_000, page_size=4))


def test_radix_turns_wait_for_their_previous_turn_and_hit_it():
    workload = load_workload(PEER_TRACE, limit=150)
    follow = [r for r in workload.requests if r.after is not None]
    assert follow and all(r.after < r.rid for r in follow)
    sim = Simulator(workload, ReplayConfig("Llama-3.1-8B", "200GiB", page_size=16))
    res = sim.run()
    by_rid = {r.rid: r for r in workload.requests}
    for r in follow:
        prev = by_rid[r.after]
        seq = prev.input_length + prev.output_length
        assert res.hits[r.rid] >= seq - seq % 16  # the whole previous turn is cached
    assert res.hit_tokens / res.input_tokens > 0.8
    sim.verify()


def test_checkpoint_placements_trade_state_hits_for_checkpoint_bytes():
    """Qwen3-Next (full + GDN state), memory that evicts nothing: without placement no hit is
    valid for the state; checkpoints at the trace's 512-token blocks (the prompt end rounded
    to them, or every 512 tokens when the path cap lets them stay) bring the hybrid hit up to
    what full KV alone hits, for checkpoint bytes the report counts."""
    runs = {
        "none": 8,
        "prompt-aligned,branch,end": 8,
        "prompt-aligned:512,branch": 8,
        "interval:512": 8,
        "interval:512,branch": 64,
    }
    workload, reports = load_workload(MOONCAKE_TRACE, limit=200), {}
    for spec, cap in runs.items():
        config = ReplayConfig("Qwen3-Next-80B-A3B-Instruct", "512GiB", checkpoints=spec, max_checkpoints_per_path=cap)
        sim = Simulator(workload, config)
        reports[spec, cap] = build_report(sim.run(), with_timeline=False)
        sim.verify()
    none, default = reports["none", 8], reports["prompt-aligned,branch,end", 8]
    full = none["hit_rate_by_component"]["full_only"]
    assert none["hit_rate"] == 0 and none["checkpoints"]["peak_bytes"] == 0
    assert none["recomputed_tokens"] == full * none["input_tokens"]
    assert 0 < default["hit_rate"] < full
    for rep in reports.values():
        assert rep["hit_rate_by_component"]["full_only"] == full  # nothing is evicted
        ck = rep["checkpoints"]
        assert ck["skipped"] == 0 and ck["peak_bytes"] >= ck["end_bytes"]
        assert rep["recomputed_tokens"] == round((full - rep["hit_rate"]) * rep["input_tokens"])
    aligned, capped, interval = (
        reports["prompt-aligned:512,branch", 8],
        reports["interval:512", 8],
        reports["interval:512,branch", 64],
    )
    assert default["hit_rate"] < aligned["hit_rate"] and full - aligned["hit_rate"] < 0.001
    assert capped["hit_rate"] < interval["hit_rate"] == full  # a path of 8 checkpoints drops the deep ones
    assert interval["checkpoints"]["end_bytes"] > 5 * aligned["checkpoints"]["end_bytes"] > 0


def test_a_request_that_cannot_fit_with_its_checkpoints_goes_on_without_them():
    """Checkpoints every page of tiny-gdn (state slots 6x a page) do not fit next to a long
    prompt in 450 KB: a request waits for them like for its pages, and once alone goes on
    without them (counted as skipped); every request is served and nothing leaks."""
    workload = synthetic()
    engine = EngineModel(max_running=8, decode_chunk=4, chunk_tokens=32)
    config = ReplayConfig("tiny-gdn", 450_000, page_size=4, checkpoints="interval:4,branch", engine=engine)
    sim = Simulator(workload, replace(config, verify_every=1))
    report = build_report(sim.run(), with_timeline=False)
    assert report["requests"] == len(workload.requests) and report["checkpoints"]["skipped"] > 0
    assert sim.mem.slots.live_count == sim.cache.num_checkpoints
    sim.verify()
