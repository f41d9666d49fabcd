"""``hybridkv bench engine``: its workload keeps the trace's shared prefixes; its report is exact and complete."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hybridkv.bench.engine import (
    OWN_CLOCK,
    CallTimer,
    EntryPoints,
    conversation_prompts,
    engine_pass,
    hybridkv_classes,
    record_entry_points,
    timed,
)
from hybridkv.cli import app
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import build_random


def test_conversation_prompts_share_the_trace_blocks_as_token_prefixes() -> None:
    prompts = conversation_prompts(64, 4)
    assert len(prompts) == 64 and all(len(p) % 4 == 0 and min(p) >= 3 and max(p) < 256 for p in prompts)
    assert min(map(len, prompts)) >= 8 and max(map(len, prompts)) <= 64 * 4
    assert prompts == conversation_prompts(64, 4)  # deterministic
    # later turns of a conversation extend an earlier request: a prefix of >= 2 blocks is shared
    shared = [p for i, p in enumerate(prompts) if any(q[:8] == p[:8] for q in prompts[:i])]
    assert len(shared) >= 32
    assert {tuple(p[:4]) for p in prompts} == {tuple(prompts[0][:4])}  # block 0: the system prompt


def test_call_timer_counts_outermost_calls_and_properties() -> None:
    class Inner:
        def outer(self) -> int:
            return self.inner() + self.inner() + self.size

        def inner(self) -> int:
            return 1

        @property
        def size(self) -> int:
            return self.inner()

        @staticmethod
        def helper() -> int:
            return 2

        @classmethod
        def make(cls) -> int:
            return cls.helper()

    timer = CallTimer()
    with timer.patch(Inner):
        assert Inner().outer() == 3
        assert Inner().inner() == 1
        assert Inner().size == 1
        assert Inner.helper() == 2 and Inner.make() == 2  # static and class methods count too
    assert timer.calls == 5 and timer.seconds >= 0
    assert set(timer.by_name) == {"Inner.outer", "Inner.inner", "Inner.size", "Inner.helper", "Inner.make"}
    assert "timed" not in repr(Inner.outer) and isinstance(vars(Inner)["size"], property)  # restored
    assert isinstance(vars(Inner)["helper"], staticmethod) and isinstance(vars(Inner)["make"], classmethod)


def test_call_timer_wraps_only_the_methods_named_and_refuses_unknown_ones() -> None:
    class Api:
        def entry(self) -> int:
            return self.helper() + 1

        def helper(self) -> int:
            return 1

    timer = CallTimer()
    with timer.patch(Api, only={"Api.entry"}):
        assert hasattr(Api.entry, "__wrapped__") and not hasattr(Api.helper, "__wrapped__")  # nested: unwrapped
        assert Api().entry() == 2 and Api().helper() == 1
    assert timer.calls == 1 and set(timer.by_name) == {"Api.entry"}  # the helper called from outside is not timed
    with pytest.raises(ValueError, match=r"Api\.gone"), timer.patch(Api, only={"Api.entry", "Api.gone"}):
        pass
    assert not hasattr(Api.entry, "__wrapped__")  # a refused patch leaves nothing wrapped


def test_a_timed_engine_pass_wraps_the_recorded_entry_points_and_checks_their_calls() -> None:
    model, config = build_random("tiny-gemma3")
    engine = Engine(config, model, EngineConfig(page_size=4, chunk_size=8))
    prompts, new = conversation_prompts(4, 4), 2
    entries = record_entry_points(engine, prompts, new)
    # the engine enters hybridkv through its KV façade; the façade's own calls into the cache are nested
    assert entries.calls > 0 and any(label.startswith("RequestKV.") for label in entries.labels)
    assert not any(label.startswith("HybridRadixCache.") for label in entries.labels)
    _, _, extra = engine_pass(engine, prompts, new, entries)
    wall, cpu = extra[OWN_CLOCK]  # its generate alone: the bench's wrapping and cache emptying are not the engine's
    assert wall > 0 and 0 < extra["hybridkv_s"] < cpu
    assert extra["hybridkv_calls"] == entries.calls and extra["hybridkv_methods_timed"] == len(entries.labels)
    assert 0 < extra["hybridkv_share"] < 1 and extra["hybridkv_share_all_wrapped"] == entries.share_all_wrapped
    with pytest.raises(RuntimeError, match="not deterministic"):  # a pass that calls in more or less often
        engine_pass(engine, prompts, new, EntryPoints(entries.labels, entries.calls + 1, 0.0))
    assert not engine.has_work()  # the refused pass still ended its requests


def test_a_contender_that_times_itself_is_credited_with_its_own_clock() -> None:
    own = timed(lambda: ([[7]], 1, {OWN_CLOCK: (1.5, 2.5), "steps": 3}))
    assert (own.wall_s, own.cpu_s, own.extra) == (1.5, 2.5, {"steps": 3})
    measured = timed(lambda: ([[7]], 1, {}))
    assert 0 <= measured.cpu_s < 1 and 0 <= measured.wall_s < 1


def test_the_hybridkv_share_times_every_memory_and_cache_class() -> None:
    names = {c.__name__ for c in hybridkv_classes()}
    assert {"UnifiedMemory", "SubPool", "HybridRadixCache", "KVManager", "KVHandle", "RequestKV"} <= names
    assert not any(issubclass(c, BaseException) for c in hybridkv_classes())


def test_bench_engine_json_is_exact_and_reports_every_contender_and_goal() -> None:
    args = ["bench", "engine", "--model", "tiny-qwen3-next", "--requests", "6", "--max-new-tokens", "3", "--json"]
    args += ["--chunk-size", "8", "--page-size", "4"]  # small chunks: later requests start after earlier ones cached
    # ... the chunks of an earlier request still in prefill: the engine's default checkpoints every chunk for them
    args += ["--rounds", "1", "--padded-batch", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert result.stderr.startswith("hybridkv bench engine: max context "), result.stderr  # sizing, at start
    (row,) = report["models"]
    assert row["model"] == "tiny-qwen3-next" and row["tokens"] == 18 and row["hidden_size"] == 64
    assert report["widen"] == 1
    runs = row["contenders"]
    assert set(runs) == {"engine", "hf_one_by_one", "hf_padded_all", "hf_padded_4"}
    assert "linear_attention" in row["not_run"]["hf_continuous"]  # transformers' continuous batching refuses it
    assert runs["engine"]["exact"] == 6 and runs["hf_one_by_one"]["exact"] == 6  # the oracle is itself
    for r in runs.values():
        assert r["cpu_s"] > 0 and r["computed_tokens"] > 0 and r["tokens_per_cpu_s"] > 0
    # padding: one batch of 6 pads every prompt to the longest; batches of 4 pad less; one by one not at all
    assert runs["hf_padded_all"]["computed_tokens"] > runs["hf_padded_4"]["computed_tokens"]
    assert runs["hf_padded_4"]["computed_tokens"] > runs["hf_one_by_one"]["computed_tokens"]
    assert runs["engine"]["computed_tokens"] < runs["hf_one_by_one"]["computed_tokens"]  # prefix hits
    eng = runs["engine"]
    assert 0 < eng["hybridkv_share"] < 1 and eng["hybridkv_calls"] > eng["steps"] > 0
    assert 0 < eng["hybridkv_share_all_wrapped"] < 1 and eng["hybridkv_methods_timed"] > 0
    assert eng["prefix_hit_rate"] > 0 and eng["cached_tokens"] > 0
    assert row["strongest_baseline"] in runs and row["cheapest_padded"] in ("hf_padded_all", "hf_padded_4")
    assert (
        isinstance(row["speedup_met"], bool) and isinstance(row["cpu_met"], bool) and isinstance(row["share_met"], bool)
    )
    # round by round the same ratios (one round here: the best passes themselves)
    assert row["speedup_rounds"] == [pytest.approx(row["speedup_vs_strongest"], abs=0.02)]
    assert row["cpu_ratio_rounds"] == [pytest.approx(row["cpu_per_computed_ratio"], abs=0.02)]
    # at the same mix: the engine's 6 x 2 decode tokens (every new token but the first) and the rest of its computed
    assert eng["decode_tokens"] == 12 and row["same_mix_padded"] in ("hf_padded_all", "hf_padded_4")
    for label in ("hf_padded_all", "hf_padded_4"):
        phases = runs[label]["phase_positions"]
        assert phases["decode"] == 12 and phases["prefill"] + phases["decode"] == runs[label]["computed_tokens"]
    assert row["cpu_same_mix_ratio"] > 0 and isinstance(row["cpu_same_mix_met"], bool)
    assert row["cpu_same_mix_rounds"] == [pytest.approx(row["cpu_same_mix_ratio"], abs=0.02)]
    # the engine's mix at the cheaper padded pass's per-phase prices, over that pass's plain CPU per computed token
    cheap = runs[row["cheapest_padded"]]
    price = cheap["cpu_us_per_phase_position"]
    mix_us = (eng["computed_tokens"] - 12) * price["prefill"] + 12 * price["decode"]
    at_prices = mix_us / eng["computed_tokens"] / cheap["cpu_us_per_computed"]
    assert row["plain_ratio_at_hf_prices"] == pytest.approx(at_prices, rel=0.05)
    assert report["checkpoints"] == "interval:8,prompt-aligned,branch,end"  # the default, resolved


def test_bench_engine_prints_the_same_mix_line_when_no_token_is_a_decode() -> None:
    # one new token a request: no decode forward anywhere, so the padded pass has no decode price to print
    args = ["bench", "engine", "--model", "tiny-qwen3-next", "--requests", "4", "--max-new-tokens", "1"]
    result = CliRunner().invoke(app, [*args, "--rounds", "1", "--padded-batch", "2"])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stdout.splitlines() if "at the same mix" in x)
    assert "prefill tokens at" in line and "decode" not in line.split("):")[0]
    assert any(x.startswith("  the mix alone: an engine paying exactly hf_padded") for x in result.stdout.splitlines())


def test_bench_engine_runs_every_contender_on_the_widened_models_and_refuses_a_bad_factor() -> None:
    args = ["bench", "engine", "--model", "tiny-gemma3", "--requests", "3", "--max-new-tokens", "2", "--rounds", "1"]
    args += ["--padded-batch", "2", "--json"]
    wide = CliRunner().invoke(app, [*args, "--widen", "2"])
    assert wide.exit_code == 0, wide.output
    report = json.loads(wide.stdout)
    (row,) = report["models"]
    assert report["widen"] == 2 and row["hidden_size"] == 128  # 64 unwidened (the test above)
    # every contender ran the widened model: the oracle's tokens are theirs
    assert all(run["exact"] == 3 for run in row["contenders"].values())
    for bad in ("0", "65"):
        refused = CliRunner().invoke(app, [*args, "--widen", bad])
        assert refused.exit_code == 2 and "--widen" in refused.output


def test_bench_engine_in_bf16_runs_every_contender_in_bf16() -> None:
    args = ["bench", "engine", "--model", "tiny-gemma3", "--requests", "2", "--max-new-tokens", "2", "--rounds", "1"]
    result = CliRunner().invoke(app, [*args, "--padded-batch", "2", "--dtype", "bfloat16", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    (row,) = report["models"]
    assert report["dtype"] == "bfloat16"
    assert row["contenders"]["hf_one_by_one"]["exact"] == 2  # the oracle, in bf16, agrees with itself
    assert row["tokens"] == 4 and all(run["computed_tokens"] > 0 for run in row["contenders"].values())
