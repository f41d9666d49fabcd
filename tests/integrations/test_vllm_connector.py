"""HybridKVConnector inside vLLM (CPU build), end to end, in a subprocess of a vLLM venv's python.

The vLLM part runs ``tests/integrations/vllm_connector_driver.py`` under ``HYBRIDKV_VLLM_PYTHON``
(default: ``.venv-vllm/bin/python`` in the repository root, made by ``scripts/setup_vllm.sh``), with
this tree on its ``PYTHONPATH``, under a timeout (its process group is killed on failure). Without
such a python the test is skipped with one line saying so.

Proved per model (a dense Llama, Gemma 3 with its sliding-window group, Qwen3-Next in bf16 with its
GDN state group): a shared-prefix workload, ``reset_prefix_cache()``, the workload again: the
connector reports external hit tokens > 0, every group loaded blocks (the state group its
checkpoint at the hit's end) and the greedy tokens equal those of the same vLLM without the
connector; every stored object damaged, reset, again: counted checksum load errors, vLLM
recomputes, tokens still equal; reset, again: the recomputed blocks were saved anew, so hits again
and no new errors. For Qwen3-Next a control: the stored states replaced by well-formed zeros (what
a connector that skips the state restores) and the tokens differ, so the equality above rests on
the restored state. And a host tier of two objects over the Mooncake Store (a master started here;
skipped without the ``mooncake`` package): after a reset the whole prefix hits, mostly from the store.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.child_driver import run_driver

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_connector_driver.py")
TIMEOUT_S = float(os.environ.get("HYBRIDKV_VLLM_TIMEOUT_S", "900"))


def vllm_python() -> tuple[Path | None, str]:
    python = Path(os.environ.get("HYBRIDKV_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not python.is_file():
        return None, f"no vLLM python at {python} (scripts/setup_vllm.sh, or set HYBRIDKV_VLLM_PYTHON)"
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=300)
    if probe.returncode != 0:
        return None, f"{python} cannot import vllm"
    return python, ""


def in_vllm(python: Path, model: str, out: Path, *extra: str, path: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The driver's report on ``model`` (``extra``: its flags; ``path``: more of ``PYTHONPATH`` after this tree)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (ROOT / "src", *path))}
    cmd = [str(python), str(DRIVER), "--model", model, "--out", str(out), *extra]
    return run_driver(cmd, out, env, TIMEOUT_S, f"vLLM driver ({model})")


def test_a_recurrent_group_hits_only_at_its_checkpoints(tmp_path: Path) -> None:
    """vLLM's MambaSpec group: without "align" checkpoints no hit even with every other block held; with
    them the hit ends at the last block-aligned state held."""
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    r = in_vllm(python, "llama", tmp_path / "spec.json", "--spec-check")
    none, align = r["none"], r["align"]
    assert none["kinds"] == ["full", "window", "unsupported"]
    assert "MambaSpec" in none["why"] and "'none'" in none["why"]
    assert none["hit_blocks"] == 0 and none["hit_blocks_without_state_group"] == 8
    assert align["kinds"] == ["full", "window", "state"] and align["why"] == ""
    assert align["hit_blocks"] == 6  # states held after 3 and 6 blocks: the longest is 6
    assert align["hit_blocks_without_state_group"] == 8


def test_evictions_reach_the_scheduler(tmp_path: Path) -> None:
    """A host tier holding one prefix of two: the one held hits, the evicted one keeps its head, no load error."""
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    # llama: one object is 2 layers x 32 tokens x 64 floats = 16 KiB + a 64-byte header; six fit
    r = in_vllm(python, "llama", tmp_path / "evict.json", "--evict-check", "--host-bytes", str(6 * (16384 + 64)))
    for got, ref in (("a1", "ref_a"), ("b1", "ref_b"), ("a2", "ref_a"), ("b2", "ref_b")):
        assert r[got] == r[ref], got
    prefix = r["prefix_blocks"] * 32
    assert r["b2_cached"][0] == prefix  # B's blocks are held: an external hit after the reset
    # A's blocks left tail first (the head serves every longer prefix): its head block survived, its
    # other blocks were evicted, and the scheduler knew it: a one-block hit
    assert r["a2_cached"][0] == 32
    worker, sched = r["report"]["worker"], r["report"]["scheduler"]
    assert worker["stats"]["evicted"] > 0 and worker["load_errors"] == {}
    assert sched["held_blocks"] == worker["tier"]["objects"]  # the index is exactly what the tier holds


def test_a_save_batch_larger_than_the_host_tier_leaves_the_index_truthful(tmp_path: Path) -> None:
    """A host tier of two objects, no store, steps that save three blocks: the blocks a batch stored and
    evicted again are not counted held, so no load is planned on them (no load error)."""
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    r = in_vllm(python, "llama", tmp_path / "batch.json", "--evict-check", "--host-bytes", str(2 * (16384 + 64)))
    for got, ref in (("a1", "ref_a"), ("b1", "ref_b"), ("a2", "ref_a"), ("b2", "ref_b")):
        assert r[got] == r[ref], got
    worker, sched = r["report"]["worker"], r["report"]["scheduler"]
    assert worker["stats"]["evicted"] > 0 and worker["load_errors"] == {}
    assert sched["held_blocks"] == worker["tier"]["objects"] <= 2


def test_a_host_tier_too_small_is_backed_by_the_mooncake_store(tmp_path: Path) -> None:
    """Two objects of host memory over the Mooncake Store: after a reset the prefix comes from the store."""
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("no mooncake package here (pip install hybridkv[mooncake]): no Mooncake Store to test against")
    link = tmp_path / "mooncake-only"  # this venv's mooncake, alone, importable by vLLM's python
    link.mkdir()
    (link / "mooncake").symlink_to(next(iter(spec.submodule_search_locations)))
    from hybridkv.tiers import MooncakeMaster

    with MooncakeMaster() as master:
        r = in_vllm(
            python, "llama", tmp_path / "store.json", "--store-master", master.address,
            "--host-bytes", str(2 * (16384 + 64)), path=(link,),
        )  # fmt: skip
    assert r["pass1"] == r["reference"] and r["pass2"] == r["reference"]
    assert r["pass2_cached"][0] == r["prefix_blocks"] * 32  # after the reset: the connector's whole prefix
    worker, sched = r["report"]["worker"], r["report"]["scheduler"]
    assert worker["tier"]["objects"] <= 2 and sched["held_blocks"] > worker["tier"]["objects"]  # the rest: below
    assert worker["stats"]["written_back"] > 0 and worker["stats"]["store_loaded_blocks"] > 0
    assert worker["stats"]["promoted"] > 0  # blocks read from the store went back into the host tier
    assert worker["load_errors"] == {} and worker["store"]["puts"] > 0


def test_connector_in_vllms_own_engine_process(tmp_path: Path) -> None:
    """vLLM's default layout: the engine core (scheduler and worker) in a child process."""
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    r = in_vllm(python, "gemma3", tmp_path / "mp.json", "--mp")
    assert r["pass1"] == r["reference"] and r["pass2"] == r["reference"]
    assert r["pass2_cached"][0] == r["prefix_blocks"] * 32  # after the reset: the connector's hit


@pytest.mark.parametrize("model", ["llama", "gemma3", "qwen3next"])
def test_connector_hits_after_reset_and_recovers_damage(model: str, tmp_path: Path) -> None:
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    r = in_vllm(python, model, tmp_path / f"{model}.json")
    expected_groups = {"llama": ["full"], "gemma3": ["window", "full"], "qwen3next": ["state", "full"]}[model]
    assert sorted(r["groups"]) == sorted(expected_groups)
    ref = r["reference"]
    # pass 1 fills the host tier; pass 2 (after reset_prefix_cache) hits it
    assert r["pass1"] == ref
    assert r["pass2"] == ref
    for n in (1, 2, 3, 4):  # the scheduler's index is exactly what the worker's tier holds
        after = r[f"after_pass{n}"]
        assert after["scheduler"]["held_blocks"] == after["worker"]["tier"]["objects"], n
    sched2 = r["after_pass2"]["scheduler"]["stats"]
    assert sched2.get("hit_tokens", 0) > 0, r["after_pass2"]
    prefix = r["prefix_blocks"] * r["block"]
    assert r["pass2_cached"][0] == prefix  # after a reset the first request's hit can only be external
    if model == "gemma3":  # the window group's blocks before the last window were dropped: still a whole hit
        assert r["window_dropped"] > 0
    worker2 = r["after_pass2"]["worker"]
    assert worker2["stats"].get("loaded_blocks", 0) > 0 and not worker2["load_errors"]
    for g in range(len(r["groups"])):  # every group restored blocks: full, window and state alike
        assert worker2["stats"].get(f"loaded_blocks_g{g}", 0) > 0, (g, r["groups"][g])
    # pass 3: every stored object damaged -> counted checksum errors, recomputed, the same tokens
    assert r["damaged"] > 0
    assert r["pass3"] == ref
    assert r["after_pass3"]["worker"]["load_errors"].get("checksum", 0) > 0
    # pass 4: the damaged objects left the tier and the recomputed blocks were saved again: hits, no new errors
    assert r["pass4"] == ref
    assert r["after_pass4"]["scheduler"]["stats"]["hit_tokens"] > r["after_pass3"]["scheduler"]["stats"]["hit_tokens"]
    assert r["after_pass4"]["worker"]["load_errors"] == r["after_pass3"]["worker"]["load_errors"]
    if "state" in r["groups"]:  # the control: zero states (checksums pass) restored with the same KV change tokens
        assert (
            r["zeroed_states"] > 0
            and r["after_pass5"]["worker"]["load_errors"] == r["after_pass4"]["worker"]["load_errors"]
        )
        assert r["pass5"] != ref
    times = ("reference_cold_s", "pass1_s", "pass2_s", "pass3_s", "pass4_s")
    print(json.dumps({k: r[k] for k in times}), file=sys.stderr)


def test_a_state_inside_a_block_is_restored(tmp_path: Path) -> None:
    """Qwen3-Next (bf16, 64-token blocks) with vLLM's prefix_match_unit of 32: vLLM ends a prompt's prefill at
    its last 32-token boundary, inside a block, and hands that state over; the connector saves it with the
    full-attention block it ends in, and after a reset restores a hit ending there (tokens equal vLLM's
    without the connector); damaged, it is recomputed; replaced by zeros, the tokens differ (the control)."""
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    r = in_vllm(python, "qwen3next", tmp_path / "tail.json", "--prefix-match-unit", "32", "--tail-tokens", "32")
    ref, block = r["reference"], r["block"]
    tail_hit = r["prefix_blocks"] * block + 32  # every prompt's last 32-token boundary: (len - 1) // 32 * 32
    assert block == 64 and tail_hit % block == 32
    assert r["pass1"] == ref and r["pass2"] == ref
    assert r["pass2_cached"][0] == tail_hit  # after a reset only the connector hits: inside the block
    sched2, worker2 = r["after_pass2"]["scheduler"]["stats"], r["after_pass2"]["worker"]
    assert sched2.get("tail_hits", 0) > 0 and not worker2["load_errors"]
    for g in range(len(r["groups"])):  # the state and the full-attention block the tail ends in
        assert worker2["stats"].get(f"loaded_blocks_g{g}", 0) > 0, (g, r["groups"][g])
    assert r["pass3"] == ref and r["after_pass3"]["worker"]["load_errors"].get("checksum", 0) > 0
    assert r["pass4"] == ref and r["pass4_cached"][0] == tail_hit  # the recomputed tail was saved again
    assert r["after_pass4"]["worker"]["load_errors"] == r["after_pass3"]["worker"]["load_errors"]
    assert r["zeroed_states"] > 0 and r["pass5_cached"][0] == tail_hit and r["pass5"] != ref
