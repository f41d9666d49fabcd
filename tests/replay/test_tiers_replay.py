"""Replays with tiers below the device: host memory and a store raise the hit rate on the
same requests; every hit token is accounted to the tier each component came from; restored
tokens cost their bytes; the real Mooncake Store works under a replay; the memory and the
tree stay consistent throughout."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli.app import main
from hybridkv.replay import ReplayConfig, build_report, load_workload, simulate
from hybridkv.replay.tiered import TierConfig
from hybridkv.spec import KindTag, get_preset
from hybridkv.traces import MOONCAKE_TRACE, PEER_TRACE


@pytest.fixture(scope="module")
def peer():
    return load_workload(PEER_TRACE, limit=200)


@pytest.mark.parametrize("model", ["Qwen3-Next-80B-A3B-Instruct", "Gemma-3-27B-IT"])
def test_host_memory_raises_the_hit_rate_of_the_same_requests(peer, model):
    device = simulate(peer, ReplayConfig(model=model, gpu_memory="4GiB"))
    tiered = simulate(
        peer, ReplayConfig(model=model, gpu_memory="4GiB", tiers=TierConfig(host_memory="16GiB"), verify_every=25)
    )
    assert tiered.requests == device.requests == 200
    assert tiered.hit_tokens > 1.2 * device.hit_tokens
    t = build_report(tiered, with_timeline=False)["tiers"]
    split = t["hit_rate_by_component_and_tier"]
    assert sum(split["full_kv"].values()) == pytest.approx(t["hit_rate"])  # every hit token has one source
    assert split["full_kv"]["host"] > 0 and split["full_kv"]["store"] == 0
    assert t["device_hit_rate"] == tiered.device_hit_tokens / tiered.input_tokens < t["hit_rate"]
    if model.startswith("Qwen3"):
        assert sum(split["checkpoint"].values()) == pytest.approx(t["hit_rate"])
    else:
        assert "window:swa:1024" in split
    assert t["misses"] == {} and t["fallbacks"] == 0
    assert t["tiers"]["host"]["used_bytes"] <= t["tiers"]["host"]["budget_bytes"]


def test_restored_tokens_cost_their_bytes_and_time(peer):
    model = "Gemma-3-27B-IT"
    res = simulate(peer, ReplayConfig(model=model, gpu_memory="4GiB", tiers=TierConfig(host_memory="16GiB")))
    t = res.tiers
    full_per_token = get_preset(model).kv_bytes_per_token(KindTag.FULL)
    assert t["restored_tokens"] > 0
    assert sum(t["bytes_loaded"].values()) >= t["restored_tokens"] * full_per_token  # each one's full KV came in
    host_s = t["bytes_loaded"]["host"] / t["bandwidth_bytes_per_s"]["host"]
    assert t["load_seconds"] == pytest.approx(host_s)
    assert t["load_seconds_per_restored_token"] == pytest.approx(t["load_seconds"] / t["restored_tokens"])


def test_host_evictions_cascade_into_a_simulated_store(peer):
    cfg = TierConfig(host_memory="2GiB", store="sim")
    res = simulate(peer, ReplayConfig(model="Gemma-3-27B-IT", gpu_memory="4GiB", tiers=cfg))
    t = res.tiers
    assert t["tiers"]["host"]["evictions"] > 0
    assert t["tiers"]["store"]["puts"] == t["objects_written"]["sim"] > 0
    assert t["hit_rate_by_component_and_tier"]["full_kv"]["store"] > 0
    host_only = TierConfig(host_memory="2GiB")
    small = simulate(peer, ReplayConfig(model="Gemma-3-27B-IT", gpu_memory="4GiB", tiers=host_only))
    assert res.hit_tokens > small.hit_tokens  # the store below holds what host memory could not


def test_replay_on_the_real_mooncake_store():
    """A tiny model, a store started by the replay on loopback (and stopped after it)."""
    workload = load_workload(PEER_TRACE, limit=60)
    cfg = ReplayConfig(model="tiny-gdn", gpu_memory="4MiB", tiers=TierConfig(store="mooncake", store_memory="32MiB"))
    device = simulate(workload, ReplayConfig(model="tiny-gdn", gpu_memory="4MiB"))
    res = simulate(workload, cfg)
    t = res.tiers
    assert res.hit_tokens > 2 * device.hit_tokens
    assert t["hit_rate_by_component_and_tier"]["checkpoint"]["store"] > 0
    assert t["tiers"]["store"]["name"] == "mooncake" and t["tiers"]["store"]["puts"] > 0
    assert t["tiers"]["store"]["get_bytes"] > 0 and t["misses"] == {}


def test_cli_reports_tiers_as_json(capsys):
    args = ["replay", "--trace", str(PEER_TRACE), "--model", "Qwen3-Next-80B-A3B-Instruct", "--gpu-memory", "4GiB"]
    assert main([*args, "--limit", "100", "--host-memory", "16GiB", "--store", "sim", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["tiers"]["config"] == "host 16GiB + sim store unbounded (back)"
    assert run["tiers"]["hit_rate"] == pytest.approx(run["hit_rate"])


@pytest.mark.parametrize(
    ("trace", "extra", "config"),
    [
        (MOONCAKE_TRACE, [], "host 16GiB (back, windows at node ends rounded down to 512)"),
        (MOONCAKE_TRACE, ["--page-size", "48"], "host 16GiB (back)"),  # 512 is no whole number of pages
        (MOONCAKE_TRACE, ["--window-align", "0"], "host 16GiB (back)"),
        (PEER_TRACE, [], "host 16GiB (back)"),  # its prompts share content at any token
    ],
)
def test_cli_aligns_windows_to_the_traces_blocks(capsys, trace, extra, config):
    args = ["replay", "--trace", str(trace), "--model", "Gemma-3-27B-IT", "--gpu-memory", "16GiB", "--limit", "20"]
    assert main([*args, "--host-memory", "16GiB", *extra, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["tiers"]["config"] == config


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--store", "disk"], "--store takes one of none, sim, mooncake"),
        (["--store-memory", "1GiB"], "need --store sim or mooncake"),
        (["--store", "sim", "--store-master", "127.0.0.1:1"], "needs --store mooncake"),
        (["--store", "mooncake", "--store-master", "nohost"], "host:port"),
        (["--host-memory", "1GiB", "--window-stride", "10"], "multiple of the page size"),
        (["--window-stride", "32"], "needs tiers below the device"),
        (["--host-memory", "1GiB", "--window-align", "10"], "multiple of the page size"),
        (["--window-align", "32"], "needs tiers below the device"),
        (["--host-memory", "lots"], "lots"),
        (["--host-memory", "1GiB", "--write-policy", "sideways"], "back or through"),
        (["--host-memory", "1GiB", "--host-gbps", "0"], "above 0"),
    ],
)
def test_cli_refuses_bad_tier_options_in_one_line(capsys, extra, says):
    args = ["replay", "--trace", str(PEER_TRACE), "--model", "Llama-3.1-8B", "--gpu-memory", "4GiB", "--limit", "5"]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_cli_without_a_master_at_the_address_is_one_line(capsys):
    args = ["replay", "--trace", str(PEER_TRACE), "--model", "tiny-gdn", "--gpu-memory", "4MiB", "--limit", "5"]
    assert main([*args, "--store", "mooncake", "--store-master", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot set up a Mooncake Store client against master 127.0.0.1:1" in err[0], err
