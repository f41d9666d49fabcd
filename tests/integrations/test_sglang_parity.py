"""The hybridkv radix-cache backend inside SGLang 0.5.23 (CPU), against SGLang's own trees, in a subprocess.

The SGLang part runs ``tests/integrations/sglang_parity_driver.py`` once (a module fixture) under
``HYBRIDKV_SGLANG_PYTHON`` (default: ``.venv-sglang/bin/python`` in the repository root, made by
``scripts/setup_sglang.sh``, which the fixture runs first: ``tests/sglang_venv.py``) with ``src`` on its
``PYTHONPATH``, under a timeout (its process group is killed on failure). Without such a python every test is
skipped with one line saying so.

What is proved (each test names its part):
- full attention: ``RadixCache`` and the plugin, replaying one seeded call sequence (shared prefixes,
  branches, repeats, locks kept open across evictions, memory pressure), agree at every step on match
  length, insert prefix length, tokens evicted, the allocator's free tokens and evictable/protected sizes;
- SWA and Mamba: the same against ``UnifiedRadixCache(FULL, SWA)`` / ``(FULL, MAMBA)``; where the two
  differ the difference is asserted and named (``DIFFERENCES`` in the driver's terms);
- the entry point declared in ``pyproject.toml`` is found by SGLang's ``load_plugins`` and registers
  ``hybridkv``; ``create_tree_cache`` with ``--radix-cache-backend hybridkv`` builds the plugin for a
  hybrid-SSM model, which serves a hit only at a cached state;
- bad input gives errors that name the problem.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.sglang_venv import sglang_python

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("sglang_parity_driver.py")
TIMEOUT_S = float(os.environ.get("HYBRIDKV_SGLANG_TIMEOUT_S", "300"))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = sglang_python()
    out = tmp_path_factory.mktemp("sglang") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(python), str(DRIVER), "--out", str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        pytest.fail(f"SGLang driver {'timed out' if rc is None else f'exited {rc}'}:\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


EXACT = ("match", "prefix_len", "free", "evictable", "protected", "protected_at_alloc", "evict_for_alloc", "evicted")


def _differing(rows: list[dict[str, Any]], fields: tuple[str, ...]) -> list[tuple[int, str, Any]]:
    return [(row["step"], f, row[f]) for row in rows for f in fields if f in row and row[f][0] != row[f][1]]


def _exercised(run: dict[str, Any]) -> None:
    """The replay did what it claims: hits, memory pressure, locks held through a pressure eviction."""
    rows = run["rows"]
    assert sum(row["match"][0] > 0 for row in rows) >= 3
    assert any(row["evict_for_alloc"][0] for row in rows), "no eviction under memory pressure"
    assert any(row["evict_for_alloc"][0] and row["protected_at_alloc"][0] > 0 for row in rows), "no lock held"
    assert all(row["ok"] for row in rows), "a request found no memory even after a drain"


@pytest.mark.parametrize("run", ["full_ps1", "full_ps4"])
def test_full_attention_matches_radix_cache_step_for_step(report: dict[str, Any], run: str) -> None:
    r = report[run]
    _exercised(r)
    assert _differing(r["rows"], EXACT) == []
    assert r["drained"][0] == r["drained"][1] and r["drained"][0][0] > 0
    # after the last drain every location is back in both allocators: nothing leaked, nothing freed twice
    assert r["final_free"] == [[r["size"]], [r["size"]]]


def test_mamba_matches_unified_radix_cache_but_keeps_full_kv_when_a_state_goes(report: dict[str, Any]) -> None:
    r = report["mamba"]
    _exercised(r)
    rows = r["rows"]
    assert sum(row["mamba_exist"][0] for row in rows if "mamba_exist" in row) >= 1  # a repeat found its state
    # every request step: equal hit (state exactly at the hit's end), equal prefix, state kept or not, equal pools
    fields = ("match", "prefix_len", "mamba_exist", "branch", "free", "evictable", "protected", "evict_for_alloc")
    assert _differing(rows, fields) == []
    ops = [row for row in rows if row.get("op") == "evict_all_states"]
    assert ops
    for row in ops:
        (sg_full, _, sg_states), (hk_full, _, hk_states) = row["evicted"]
        assert sg_states == hk_states  # the same states go
        # DIFFERENCE (named): SGLang frees the full KV of a leaf whose state it evicts; hybridkv keeps the
        # full KV (still a prefix for longer requests that store a state further on) until it is evicted
        # for its own sake, so the drain after frees the rest: the totals agree
        assert hk_full == 0
        assert sg_full + row["resync"][0][0] == hk_full + row["resync"][1][0]
        assert row["probes"] and all(a == b for a, b in row["probes"])  # no hit differs meanwhile
    assert any(row["evicted"][0][0] > 0 for row in ops)
    assert r["final_free"] == [[r["size"], 6], [r["size"], 6]]


def test_swa_matches_unified_radix_cache_and_names_each_difference(report: dict[str, Any]) -> None:
    r = report["swa"]
    _exercised(r)
    rows = r["rows"]
    by_step = {row["step"]: row for row in rows}
    for step, field, (sg, hk) in _differing(rows, (*EXACT, "swa_evictable")):
        row = by_step[step]
        if field == "evicted":
            # DIFFERENCE (named, window expiry): evicting every unlocked window, hybridkv also drops a leaf
            # all of whose windows are gone (no hit can end in it), SGLang keeps the full KV before its last
            # window; the drain after frees the rest, so the totals agree
            assert row["op"] in ("evict_all_windows", "drain")
            if row["op"] == "evict_all_windows":
                assert hk[0] >= sg[0]
                assert sg[0] + row["resync"][0][0] == hk[0] + row["resync"][1][0]
            continue
        # DIFFERENCE (named, lock scope): a lock protects the window before its node's end; hybridkv splits
        # the node there and protects exactly that span, SGLang protects whole locked nodes; so with a lock
        # open the window tokens each may evict differ (both keep what the lock holder reads)
        # (a run of differing steps starts at a window eviction made while a lock was open: a request's own
        # match lock during its allocation, or one kept from an earlier step; it lasts until a drain)
        first = step
        while first - 1 in by_step and _differing([by_step[first - 1]], (*EXACT, "swa_evictable")):
            first -= 1
        start = by_step[first]
        assert start["protected_at_alloc"][0] > 0 or start["protected"][0] > 0, (step, field, sg, hk)
        if field == "match":
            # the one hit this costs: SGLang still holds the window of a shorter prefix of a locked path
            assert hk < sg and by_step[step]["op"] == "evict_all_windows", (step, sg, hk)
    ops = [row for row in rows if row.get("op") == "evict_all_windows"]
    assert len(ops) >= 3 and any(row["evicted"][0][1] > 0 for row in ops)
    assert sum(row["match"][0] == row["match"][1] for row in rows) >= len(rows) - 2
    assert all(a == b for row in ops for a, b in row["probes"])
    assert r["final_free"] == [[r["size"], 96], [r["size"], 96]]


def test_the_entry_point_registers_the_backend_and_create_tree_cache_builds_it(report: dict[str, Any]) -> None:
    p = report["plugin"]
    assert p["declared"] == {"hybridkv": "hybridkv.integrations.sglang.plugin:register"}
    assert "hybridkv" not in p["before"] and "hybridkv" in p["after"]
    assert p["type"] == "hybridkv.integrations.sglang.radix_cache.HybridKVRadixCache"
    assert p["supports_mamba"] is True
    assert p["hit_at_state"] == 6 and p["hit_without_state"] == 0


def test_bad_input_is_refused_with_what_to_change(report: dict[str, Any]) -> None:
    b = report["bad_input"]
    expect = {
        "key_not_radixkey": "expected a RadixKey, got list",
        "token_ids_of_strings": "token ids must be a 1-D sequence of ints",
        "float_value": "value must be an integer tensor",
        "value_too_short": "one location per key token",
        "location_out_of_range": "outside its allocator's pages",
        "lock_other_cache_node": "is not in this cache",
        "lock_not_a_node": "expected a node from this cache",
        "double_unlock": "no lock is open on",
        "lock_evicted_node": "is not in this cache",
    }
    for name, text in expect.items():
        assert b[name].startswith("HybridKVSGLangError: ") and text in b[name], (name, b[name])
    assert b["tree_still_valid"] == "yes"


def test_expired_windows_come_back_when_the_prefix_is_inserted_again(report: dict[str, Any]) -> None:
    """SWA recovery (SGLang) and window adoption (hybridkv): equal hits, equal pools, nothing leaked."""
    sg, hk = report["swa_recover"]["sglang"], report["swa_recover"]["plugin"]
    assert sg["hit_after_expiry"] == hk["hit_after_expiry"] == 0  # the windows before the locked end expired
    assert sg["hit_after_insert"] == hk["hit_after_insert"] == 12
    assert hk["adopted"] == 12  # the plugin took this path: the new window pages went onto cached full KV
    for field in ("expired", "prefix_len", "free_while_locked", "drained", "free"):
        assert sg[field] == hk[field], field
    assert hk["free"] == [128, 64]


def test_checkpoint_writes_back_as_radix_cache_does(report: dict[str, Any]) -> None:
    """``checkpoint(req, up_to)`` with real ``Req`` objects: the same prefix, protected length, pools and
    sizes as ``RadixCache``, and the request's row repointed at the tree's locations."""
    sg, hk = report["checkpoint"]["sglang"], report["checkpoint"]["plugin"]
    assert sg == hk
    assert [r["matched"] for r in hk] == [0, 0] and [r["protected_len"] for r in hk] == [20, 20]
    assert all(r["row_reads_tree"] for r in hk)
    # a: 20 tokens; b: 21 tokens on 6 pages, of which its first 12 (a's too) were freed at its write-back
    assert hk[0]["free"] == [128 - 20 - 24] and hk[1]["free"] == [128 - 20 - 24 + 12]
