"""``hybridkv bench pd``: the moved bytes equal the spec's size of each request, and every ratio is measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridkv.bench.pd import _covered, _union, spec_bytes
from hybridkv.cli import app
from hybridkv.engine.random_models import save_random


def test_interval_cover_and_union_count_overlapping_intervals_once() -> None:
    assert _covered((0.0, 10.0), [(2.0, 4.0), (3.0, 5.0), (9.0, 12.0), (-3.0, -1.0)]) == pytest.approx(4.0)
    assert _covered((0.0, 1.0), []) == 0.0
    assert _union([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)


def test_bench_pd_json_moves_the_spec_bytes_and_measures_ttft_and_overlap() -> None:
    # Gemma 3 (sliding window 8) on pages of 4: the window pools send only the pages the window keeps, and
    # a prefill prefix-cache hit still sends the whole request
    args = ["bench", "pd", "--model", "tiny-gemma3", "--requests", "3", "--max-new-tokens", "3", "--page-size", "4"]
    result = CliRunner().invoke(app, [*args, "--chunk-size", "16", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    sizing = result.stderr.splitlines()[0]
    assert sizing.startswith("hybridkv bench pd: max context ") and "per process" in sizing, result.stderr
    assert report["requests"] == 3 and report["prefill_pp"] == 2 and report["decode_tp"] == 2
    assert report["dtype"] == "float32"
    rows = report["per_request"]
    assert len(rows) == 3
    for r in rows:
        assert r["transfer_bytes_per_rank"] == r["spec_bytes_per_rank"] and r["bytes_match"], r
        assert all(b > 0 for b in r["spec_bytes_per_rank"]) and r["transfer_bytes"] == r["spec_bytes"]
        assert r["transfer_s"] > 0 and r["gbps"] > 0 and r["handoff_s"] >= 0
        assert r["ops"] > 0 and r["send_us_per_op"] == pytest.approx(r["send_s"] * 1e6 / r["ops"], abs=0.01)
        assert 0 <= r["overlap_other_stage_ratio"] <= r["overlap_ratio"] <= 1 and r["send_s"] >= r["transfer_s"]
        assert r["ttft_pd_s"] > 0 and r["ttft_single_s"] > 0 and r["ttft_ratio"] > 0
        assert r["exact"]
        assert [(s["pp"], s["tp"]) for s in r["stages"]] == [(0, 0), (1, 0)]
        assert all(s["send"][0] >= s["compute"][1] for s in r["stages"])  # a stage sends what it computed
    # a longer prompt holds more full-attention pages, so more bytes
    by_length = sorted(rows, key=lambda r: r["prompt_tokens"])
    assert by_length[0]["spec_bytes"] < by_length[-1]["spec_bytes"]
    t = report["totals"]
    assert t["bytes_match"] and t["transfer_bytes"] == sum(r["transfer_bytes"] for r in rows)
    assert t["ops"] == sum(r["ops"] for r in rows)
    assert t["cached_tokens_pd"] > 0, rows  # each request served again alone hits its own cached prompt
    assert all(r["alone_cached_tokens_pd"] > 0 and r["alone_cached_tokens_single"] > 0 for r in rows), rows
    assert t["exact"] == 3 and t["ttft_ratio"] > 0 and t["gbps"] > 0 and 0 <= t["overlap_ratio"] <= 1
    assert t["prefill_tokens_per_s_pd"] > 0 and t["prefill_throughput_ratio"] > 0 and t["handoff_mean_ms"] >= 0
    assert isinstance(t["ttft_goal_met"], bool) and t["alone_ttft_pd_mean_s"] > 0


def test_bench_pd_in_bf16_moves_the_bf16_spec_bytes_and_stays_exact(tmp_path: Path) -> None:
    args = ["bench", "pd", "--model", "tiny-gemma3", "--requests", "1", "--max-new-tokens", "2", "--page-size", "4"]
    result = CliRunner().invoke(app, [*args, "--dtype", "bfloat16", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    (row,) = report["per_request"]
    assert report["dtype"] == "bfloat16" and row["bytes_match"] and row["exact"], row
    save_random("tiny-gemma3", str(tmp_path))  # attention only: bf16 K/V is half of fp32's, byte for byte
    assert row["spec_bytes"] * 2 == sum(spec_bytes(str(tmp_path), 2, 4, row["prompt_tokens"]))
