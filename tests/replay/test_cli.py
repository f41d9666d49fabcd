"""The ``replay`` and ``bench cache`` commands and the demo's replay, end to end."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from hybridkv.bench.cache import HybridBench, PageHashCache, memory_for_tokens, radix_requests, replay
from hybridkv.cli import app
from hybridkv.replay import run_demo_replay
from hybridkv.traces import MOONCAKE_TRACE, PEER_TRACE, load_peer_trace

runner = CliRunner()


def test_replay_compares_policies_as_json_and_plots(tmp_path):
    png = tmp_path / "split.png"
    args = ["replay", "--trace", str(MOONCAKE_TRACE), "--model", "Gemma-3-27B-IT", "--gpu-memory", "12GiB"]
    result = runner.invoke(app, [*args, "--limit", "40", "--policy", "lru,cost", "--json", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert [r["policy"] for r in out["runs"]] == ["lru", "cost"]
    assert [row["policy"] for row in out["comparison"]] == ["lru", "cost"]
    for run in out["runs"]:
        assert run["model"] == "Gemma-3-27B-IT" and run["requests"] == 40
        assert 0 <= run["hit_rate"] <= run["hit_rate_by_component"]["full_only"] <= 1
        assert run["timeline"] and set(run["timeline"][0]["live_bytes"]) == {"full", "swa:1024"}
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_replay_tables_and_bad_options():
    args = ["replay", "--trace", str(PEER_TRACE), "--model", "Llama-3.1-8B", "--gpu-memory", "20GiB", "--limit", "30"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "hit rate (tokens) by component rules" in result.stdout
    bad = runner.invoke(app, [*args, "--cache-tokens", "lots"])
    assert bad.exit_code != 0 and "token count or 'inf'" in bad.output
    bad = runner.invoke(app, [*args, "--policy", "lru,fifo"])
    assert bad.exit_code != 0 and "unknown policy" in bad.output


def test_demo_replay_writes_a_plot(tmp_path):
    report = run_demo_replay(tmp_path)
    assert report["requests"] == 300 and 0 < report["hit_rate"] < 1
    assert report["model"] == "Qwen3-Next-80B-A3B-Instruct"
    assert (tmp_path / "replay_pool_split.png").stat().st_size > 10_000


def test_bench_protocol_hits_the_token_trie_bound_and_matches_the_baseline():
    requests = radix_requests(load_peer_trace(PEER_TRACE))[:300]
    trie: dict = {}
    hit = total = 0
    for req in requests:  # a token trie of every earlier sequence, page size 1
        node, k = trie, 0
        for t in req.input.tolist():
            if t not in node:
                break
            node, k = node[t], k + 1
        hit, total = hit + k, total + req.input.size
        node = trie
        for t in req.sequence.tolist():
            node = node.setdefault(t, {})
    tokens = sum(r.sequence.size for r in requests)
    for impl in (HybridBench, PageHashCache):
        mem = memory_for_tokens("Llama-3.1-8B", tokens, 1)
        res = replay(requests, mem, impl(mem))
        assert (res.matched, res.inputs, res.evicted, res.host_syncs) == (hit, total, 0, 0)
    small = {}
    for impl in (HybridBench, PageHashCache):
        mem = memory_for_tokens("Llama-3.1-8B", 20_000, 16)
        res = replay(requests, mem, impl(mem))
        assert res.evicted > 0 and res.matched < hit and len(res.op_ns["evict"]) > 0
        small[impl.__name__] = res.matched
        mem.verify()
    assert np.isclose(small["HybridBench"], small["PageHashCache"], rtol=0.05)  # both LRU


def test_replay_sweeps_memory_and_placements_into_a_hit_rate_plot(tmp_path):
    png = tmp_path / "hit.png"
    args = ["replay", "--trace", str(MOONCAKE_TRACE), "--model", "Qwen3-Next-80B-A3B-Instruct", "--limit", "30"]
    args += ["--gpu-memory", "20GiB,40GiB", "--checkpoints", "none", "--checkpoints", "prompt-aligned:512,branch"]
    result = runner.invoke(app, [*args, "--json", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    runs = [(r["gpu_memory"], r["checkpoints"]["placement"]) for r in out["runs"]]
    assert runs == [(m, c) for m in ("20GiB", "40GiB") for c in ("none", "prompt-aligned:512,branch")]
    assert [(row["gpu_memory"], row["checkpoints"]) for row in out["comparison"]] == runs
    for run in out["runs"]:
        rate = run["hit_rate_by_component"]
        assert run["hit_rate"] <= rate["full+state"] <= rate["full_only"]
        assert {"peak_bytes", "end_bytes", "skipped"} <= set(run["checkpoints"]) and run["recomputed_tokens"] >= 0
    assert out["runs"][0]["hit_rate"] == 0 < out["runs"][1]["hit_rate"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    table = runner.invoke(app, args)
    assert table.exit_code == 0 and "by component rules" in table.stdout and "40GiB" in table.stdout
    for bad, message in (("interval:500", "multiple of the page size 16"), ("sometimes", "unknown checkpoint")):
        refused = runner.invoke(app, [*args, "--checkpoints", bad])
        assert refused.exit_code != 0 and message in refused.output
    refused = runner.invoke(app, [*args[:-4], "--gpu-memory", "20GiB,lots"])
    assert refused.exit_code != 0 and "lots" in refused.output
