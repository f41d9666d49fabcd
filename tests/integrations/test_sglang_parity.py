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
- bad input gives errors that name the problem;
- the scheduler's write-back ``checkpoint(req, up_to)`` and ``match_prefix(cow_mamba=True)`` with real
  ``Req`` objects, ``checkpoint_kv_cache`` and ``release_kv_cache``: as ``RadixCache`` (full attention) and
  as ``UnifiedRadixCache`` (FULL + SWA at page sizes 1 and 4, FULL + MAMBA), each difference named and
  asserted, and where hybridkv is stricter (errors SGLang's tree gives as bare assertions or leaks);
- 100 seeded requests each through the scheduler's calls (two running together half the time) on
  FULL + MAMBA, FULL + SWA (page sizes 1 and 4) and FULL + SWA + MAMBA: equal per request, and SGLang's
  idle pool identity and leak census hold after every group;
- the token-to-KV allocator over ``UnifiedMemory`` (``allocator.py``) against SGLang's own allocators of the
  same size, call for call (page sizes 1 and 4), with ``mem.verify()`` after every step; the plugin's
  cache over it equal to over SGLang's; its bad input; its opt-in hook.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.child_driver import run_driver
from tests.sglang_venv import sglang_python

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("sglang_parity_driver.py")
TIMEOUT_S = float(os.environ.get("HYBRIDKV_SGLANG_TIMEOUT_S", "300"))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = sglang_python()
    out = tmp_path_factory.mktemp("sglang") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return run_driver([str(python), str(DRIVER), "--out", str(out)], out, env, TIMEOUT_S, "SGLang driver")


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


def _pairs(section: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    sg, hk = section["sglang"]["steps"], section["plugin"]["steps"]
    assert [s["what"] for s in sg] == [h["what"] for h in hk]
    return list(zip(sg, hk, strict=True))


def _diff(a: dict[str, Any], b: dict[str, Any]) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_mamba_checkpoint_and_copy_on_write_match_unified_radix_cache(report: dict[str, Any]) -> None:
    """``checkpoint`` (chunked prefill: the tree gets a copy of the state; finished: the request's slot
    itself, or it is freed where a state is cached already) and ``match_prefix(cow_mamba=True)`` (the
    request's own slot, the cached state named as its copy source), with real ``Req`` objects and
    ``release_kv_cache``, against ``UnifiedRadixCache(FULL, MAMBA)``: every step equal (hits, protected
    length, rows, full and Mamba free counts, which state was copied) but one named difference."""
    r = report["checkpoint_mamba"]
    steps = {s["what"]: (s, h) for s, h in _pairs(r)}
    for what, (sg, hk) in steps.items():
        if what == "d admitted, no slot free":
            # DIFFERENCE (named, eviction order): with no slot free the match evicts one unlocked state;
            # which one is each tree's policy (SGLang: a's at 24, hybridkv: b's at 20). Both evict exactly
            # one, both keep the state the request copies (locked meanwhile), the pools agree
            assert _diff(sg, hk) == {"probes"}
            assert sg["probes"][3] == hk["probes"][3] == 28
            lost = [sum(p < f for p, f in zip(side["probes"], (12, 20, 24, 28), strict=True)) for side in (sg, hk)]
            assert lost == [1, 1]
            continue
        assert sg == hk, (what, _diff(sg, hk))
    hk = {what: h for what, (_, h) in steps.items()}
    # a: 24 tokens, its slot and the copy the chunk's checkpoint made: 2 of 6 slots
    assert hk["a checkpoint 12"]["protected_len"] == 12 and hk["a checkpoint 12"]["free"] == [104, 4]
    assert hk["a checkpoint 12"]["row_reads_tree"] and hk["a checkpoint 12"]["holds_mamba"]
    assert hk["a released"]["holds_mamba"] and hk["a released"]["free"] == [104, 4]  # its slot went to the tree
    # b: a hit at a's chunk state, copied into b's own slot (the copy's value names the length 12)
    assert hk["b admitted"]["match"] == 12 and hk["b admitted"]["cow_state"] == hk["b admitted"]["req_state"] == 12.0
    assert hk["b checkpoint all (unfinished)"]["protected_len"] == 20
    # finished at 20, where its unfinished checkpoint cached a copy already: the tree keeps that one and
    # the request's own slot is freed
    assert not hk["b released"]["holds_mamba"] and hk["b released"]["free"] == [96, 3]
    # c: a hit on the state a handed over when it finished
    assert hk["c admitted"]["match"] == 24 and hk["c admitted"]["cow_state"] == 24.0
    assert hk["d admitted, no slot free"]["match"] == 28 and hk["d admitted, no slot free"]["cow_state"] == 28.0
    sg_end, hk_end = r["sglang"], r["plugin"]
    assert sg_end["probes"] == hk_end["probes"] == {"a": 24, "a12": 12, "b": 20, "c": 28}
    assert sg_end["drained"] == hk_end["drained"] and hk_end["free"] == sg_end["free"] == [128, 6]
    # a running request's write-back with no slot free for the copy: the one cached state is evicted for it
    sg_ev, hk_ev = sg_end["checkpoint_evicts"], hk_end["checkpoint_evicts"]
    assert sg_ev["before"] == hk_ev["before"] and sg_ev["before"][1] == 0
    assert sg_ev["protected_len"] == hk_ev["protected_len"] == 5 and sg_ev["hit_new"] == hk_ev["hit_new"] == 5
    assert sg_ev["hit_old"] == hk_ev["hit_old"] == 0  # the state went on both sides
    # DIFFERENCE (named, state eviction, as in the insert replay): SGLang frees the leaf's 8 full tokens
    # with its state, hybridkv keeps them (a prefix still); the drain after frees the same total
    assert (sg_ev["full_old"], hk_ev["full_old"]) == (0, 8)
    assert sg_ev["after"][0] - hk_ev["after"][0] == 8 and sg_ev["after"][1] == hk_ev["after"][1]
    assert sg_ev["drained"][0] + 8 == hk_ev["drained"][0] and sg_ev["free"] == hk_ev["free"] == [128, 6]
    errors = hk_end["errors"]
    assert errors["cow_without_req"].startswith("HybridKVSGLangError: ") and "req is None" in errors["cow_without_req"]
    assert "holds no req_to_token row" in errors["checkpoint_released_req"]
    # no slot free and the matched state the only one cached: both refuse rather than evict the state
    # they are about to copy, and it is still cached after
    assert (
        errors["cow_no_slot"].startswith("HybridKVSGLangError: ") and "no Mamba slot is free" in errors["cow_no_slot"]
    )
    assert sg_end["errors"]["cow_no_slot"] == "AssertionError: Can not alloc mamba cache"
    assert errors["cow_no_slot_state_kept"] is True and sg_end["errors"]["cow_no_slot_state_kept"] is True
    # a write-back shorter than the request's hit: hybridkv refuses before the tree changes and gives the
    # state copy back (pools as before, the request then finishes and drains clean); SGLang asserts after
    # its insert, with the copy slot gone
    assert errors["short_hit"] == sg_end["errors"]["short_hit"] == 12
    assert "12 tokens protected by the tree but writes back only 4" in errors["checkpoint_short"]
    assert errors["short_free_kept"] is True and errors["short_free_after"] == [128, 6]
    assert sg_end["errors"]["checkpoint_short"].startswith("AssertionError")
    assert sg_end["errors"]["short_free_kept"] is False
    # stricter than SGLang's tree, which asserts without a message / fails on a None slot (and leaks one)
    assert sg_end["errors"]["cow_without_req"].startswith("AssertionError")
    assert sg_end["errors"]["checkpoint_released_req"].startswith("AttributeError")


# per SWA write-back run: page size, the span whose windows a's chunk freed and b recomputed (the rows
# differ there), the first chunk's SWA cursor and pools, b's hit / full hit / branch, the lock-scope step
SWA_RUNS = {
    "checkpoint_swa": {"span": [1, 2, 3, 4, 5], "cursor": 7, "a12_free": [104, 47], "b": (0, 6, 6), "scope": (5, 4)},
    "checkpoint_swa_ps4": {"span": [0, 1, 2, 3], "cursor": 4, "a12_free": [104, 44], "b": (0, 4, 4), "scope": None},
}


@pytest.mark.parametrize("run", list(SWA_RUNS))
def test_swa_checkpoint_matches_unified_radix_cache_and_names_each_difference(report: dict[str, Any], run: str) -> None:
    """``checkpoint`` on FULL + SWA (page sizes 1 and 4, window 4) with real ``Req`` objects,
    ``checkpoint_kv_cache`` and ``release_kv_cache``: the request's own window slots behind its window are
    freed first (its pages enter the tree tombstoned), a match whose windows are gone names a branch and the
    first write-back stops there (restoring that hit); against ``UnifiedRadixCache(FULL, SWA)`` hits,
    protected lengths and both pools agree at every step."""
    r, want = report[run], SWA_RUNS[run]
    pairs = _pairs(r)
    hk = {h["what"]: h for _, h in pairs}
    for sg, h in pairs:
        assert sg.get("free") == h.get("free"), sg["what"]
        differ = _diff(sg, h)
        if "row" in differ:
            # DIFFERENCE (named, recovery): b's first tokens had lost their windows (a freed them behind its
            # window). SGLang's recovery puts b's own locations (full + window) into the tree for that span;
            # hybridkv keeps the tree's full locations (a's) and moves b's window cells onto them (window
            # adoption), freeing b's full part. Both rows read their own tree, pools are equal; a later
            # request's fresh tail may get other locations (the two allocators' free lists differ since)
            bad = [i for i, (x, y) in enumerate(zip(sg["row"], h["row"], strict=True)) if x != y]
            span = want["span"]
            assert bad[: len(span)] == span, (sg["what"], bad)
            fresh_from = hk[sg["what"].split()[0] + " admitted"]["match"] if sg["what"].startswith("c") else 10**6
            assert all(i >= max(fresh_from, span[-1] + 1) for i in bad[len(span) :]), (sg["what"], bad)
            assert sg["row_reads_tree"] and h["row_reads_tree"]
        if {"swa_evictable", "swa_protected"} & differ:
            # DIFFERENCE (named, lock scope): the lock moved onto b's branch node protects the window before
            # its end in hybridkv, the node's whole resident window in SGLang
            assert want["scope"] is not None and sg["what"] == "b checkpoint all (unfinished)"
            assert (sg["swa_protected"], h["swa_protected"]) == want["scope"]
            assert sg["swa_evictable"] + sg["swa_protected"] == h["swa_evictable"] + h["swa_protected"]
        assert differ <= {"row", "swa_evictable", "swa_protected"}, (sg["what"], differ)
    assert any("row" in _diff(sg, h) for sg, h in pairs)  # the recovery path ran
    a12 = hk["a checkpoint 12"]
    # window 4: the chunk's write-back freed a's own window slots behind its window first, then inserted
    assert a12["swa_evicted_seqlen"] == want["cursor"] and a12["free"] == want["a12_free"] and a12["row_reads_tree"]
    b = hk["b admitted"]
    assert (b["match"], b["full_match"], b["swa_branching"]) == want["b"]
    first = hk["b checkpoint all (unfinished)"]
    assert first["protected_len"] == want["b"][2] and first["branching_after"] is None  # to the branch only
    assert hk["b checkpoint all again"]["protected_len"] == 16
    assert hk["c admitted"]["match"] == 24
    assert hk["c checkpoint all (unfinished)"]["protected_len"] == 28
    sg_end, hk_end = r["sglang"], r["plugin"]
    assert sg_end["probes"] == hk_end["probes"] == {"a": 24, "a12": 12, "b": 16, "c": 28}
    assert sg_end["drained"] == hk_end["drained"] and sg_end["free"] == hk_end["free"] == [128, 64]


# per scheduler replay: at least this many hits, hits shorter than the prompt, SWA branches, copies-on-write
SCHED_RUNS = {
    "sched_mamba": {"hits": 8, "partial": 5, "branches": 0, "cows": 8, "free": [160, 16]},
    "sched_swa": {"hits": 8, "partial": 5, "branches": 2, "cows": 0, "free": [160, 96]},
    "sched_swa_ps4": {"hits": 8, "partial": 5, "branches": 2, "cows": 0, "free": [160, 96]},
    "sched_swa_mamba": {"hits": 5, "partial": 3, "branches": 5, "cows": 5, "free": [160, 96, 16]},
}


@pytest.mark.parametrize("run", list(SCHED_RUNS))
def test_requests_through_the_scheduler_calls_match_unified_radix_cache(report: dict[str, Any], run: str) -> None:
    """100 seeded requests (shared heads, branches, repeats), one at a time or two running together, each
    admitted with copy-on-write, written back at random chunk ends (``checkpoint_kv_cache``, two requests'
    interleaved) and finished (``release_kv_cache``), drained when short with nothing running: every
    request's hit, full hit, branch, copied state, protected lengths, pools and evictable size equal
    ``UnifiedRadixCache``'s (FULL + MAMBA, FULL + SWA at page sizes 1 and 4, FULL + SWA + MAMBA), and every
    write-back leaves the row reading the tree."""
    r, want = report[run], SCHED_RUNS[run]
    sg, hk = r["sglang"]["rows"], r["plugin"]["rows"]
    assert [row for row in sg if row != hk[row["step"]]] == []
    ps = 4 if run.endswith("ps4") else 1
    assert all(all(row["reads_tree"]) for row in hk)
    assert all(p % ps == 0 and p >= row["match"] for row in hk for p in row["protected"])
    assert sum(row["match"] > 0 for row in hk) >= want["hits"]
    assert sum(0 < row["match"] < row["len"] for row in hk) >= want["partial"]
    assert sum("drained" in row for row in hk) >= 5 and sum(len(row["protected"]) for row in hk) >= 50
    # two requests ran together: one wrote back tokens the other had computed too, whose copies went
    assert sum(row["group"] == 2 for row in hk) >= 40 and r["plugin"]["duplicate_pages"] > 0
    assert sum(row["swa_branching"] is not None for row in hk) >= want["branches"]
    cows = [row for row in hk if row.get("cow_state") is not None]
    assert len(cows) >= want["cows"]
    # the state copied into the request's slot is the one stored after exactly the hit's tokens
    assert all(row["cow_state"] == row["req_state"] == float(row["match"]) for row in cows)
    if want["cows"]:
        assert all(row["match"] == 0 or row["cow_state"] is not None for row in hk)
    # SGLang's idle check (free + evictable + protected == capacity per pool, and its leak census over
    # all_values_flatten / all_mamba_values_flatten) holds after every group (the rows carry it)
    idle = [row["idle"] for row in hk if "idle" in row]
    assert len(idle) >= 50
    for census in idle:
        for pool, value in census.items():
            if isinstance(value, list):
                assert value[0] + value[1] + value[2] == value[3], (pool, value)
            else:
                assert value is True, pool
    assert all("mamba_census" in c for c in idle) == ("mamba" in run)
    if "mamba" in run:  # a hit's state is locked while its request runs (with a second one running too)
        assert {row["mamba_protected"] for row in hk} >= {0, 1}
    assert r["sglang"]["drained"] == r["plugin"]["drained"]
    assert r["sglang"]["free"] == r["plugin"]["free"] == want["free"]


@pytest.mark.parametrize("run", ["alloc_ps1", "alloc_ps4"])
def test_token_allocator_over_unified_memory_matches_sglangs_call_for_call(report: dict[str, Any], run: str) -> None:
    """hybridkv's token-to-KV allocator vs SGLang's own of the same size: every call succeeds or is refused
    on both, ``available_size`` equal after every step, both sides' locations valid (page-aligned rows,
    no page in two rows, inside the pool), hybridkv's live pages exactly the rows' pages, ``mem.verify()``
    clean after every step, and at the end every location free and handed out again."""
    r = report[run]
    assert r["problems"] == []
    assert [(row["step"], row["ok"]) for row in r["rows"] if row["ok"][0] != row["ok"][1]] == []
    assert [(row["step"], row["available"]) for row in r["rows"] if row["available"][0] != row["available"][1]] == []
    c = r["counts"]
    # the replay did what it claims: refusals under pressure, every kind of free, groups
    assert c.get("extend_refused", 0) >= 3 and c.get("decode", 0) >= 10 and c.get("group", 0) >= 5
    assert min(c.get("free", 0), c.get("segments", 0), c.get("pages", 0)) >= 5
    size = 96 if run == "alloc_ps1" else 160
    assert r["final_available"] == [size, size] and r["reuse_all"] == [True, True]


def test_radix_cache_over_the_token_allocator_equals_it_over_sglangs(report: dict[str, Any]) -> None:
    """``HybridKVRadixCache`` over hybridkv's allocator replays ``full_ps4`` exactly as over SGLang's
    (and so as ``RadixCache``): the same hits, inserts, evictions, free sizes per step."""
    a, b = report["full_ps4"], report["full_ps4_hkalloc"]
    _exercised(b)
    assert _differing(b["rows"], EXACT) == []
    assert [{k: v for k, v in row.items()} for row in a["rows"]] == b["rows"]
    assert b["drained"] == a["drained"] and b["final_free"] == [[160], [160]]


def test_token_allocator_bad_input_names_both_sides(report: dict[str, Any]) -> None:
    b = report["alloc_bad_input"]
    expect = {
        "size_below_page": "pass sizes.max_total_num_tokens",
        "dtype_not_dtype": "must be a torch.dtype",
        "kv_pool_page_size": "does not hold this allocator's locations",
        "kv_pool_dtype": "dtype torch.bfloat16",
        "unaligned_alloc": "PagedTokenToKVPoolAllocator would silently hand out 4 locations",
        "extend_count_mismatch": "extend_num_tokens 7 but the lengths add up to 5",
        "extend_float_lens": "must be a 1-D int64/int32 tensor",
        "extend_last_loc_other_device": "last_loc is on meta, the allocator on cpu",
        "free_float": "int64/int32 tensor",
        "free_other_device": "ids on meta, the allocator on cpu",
        "segment_unaligned_start": "not page-aligned",
        "nested_group": "a free group is open",
    }
    for name, text in expect.items():
        assert b[name].startswith("HybridKVAllocatorError: ") and text in b[name], (name, b[name])
    assert b["sglang_unaligned_alloc_len"] == "4"  # what SGLang does with the same call
    assert b["alloc_extend_page_size_1"].startswith("NotImplementedError")
    assert b["sglang_alloc_extend_page_size_1"].startswith("NotImplementedError")
    for ps, sg in (("ps1", "TokenToKVPoolAllocator"), ("ps4", "PagedTokenToKVPoolAllocator")):
        for name in (f"double_free_{ps}", f"double_free_in_group_{ps}"):
            assert "nothing freed" in b[name] and f"SGLang's {sg} does not check" in b[name], b[name]
        assert b[f"unchanged_{ps}"] == "True"


def test_token_allocator_hook_is_opt_in_and_keeps_what_it_does_not_serve(report: dict[str, Any]) -> None:
    h = report["alloc_hook"]
    assert h["off_hooks"] == 0
    assert "HYBRIDKV_SGLANG_ALLOCATOR='yes'" in h["bad_value"]
    assert h["on_hooks"] == [["around", "build_allocator_around"]]  # registered once, register() twice
    assert {"sizes", "token_to_kv_pool", "req_to_token_pool", "token_to_kv_pool_allocator"} <= set(h["builder_params"])
    assert h["plain"] == ["HybridKVTokenToKVPoolAllocator", 64, 4, "torch.float16", 64]
    assert h["draft"] == "PagedTokenToKVPoolAllocator" and h["swa"] == "SWATokenToKVPoolAllocator"


def test_token_allocator_reads_no_device_data_to_allocate(report: dict[str, Any]) -> None:
    """On the ``meta`` device (no data: every host read raises) allocation works from the host lengths
    alone, continuation included; a free is the one documented read."""
    r = report["alloc_no_device_read"]
    assert r["alloc"] == ["meta", [8], 56]
    assert r["alloc_extend"] == ["meta", [8], 48]  # 6 -> 11 continues a page and takes one; 0 -> 3 takes one
    assert r["alloc_decode"] == ["meta", [2], 44]  # position 11 continues its page, position 4 starts one
    assert r["free"] == "NotImplementedError"


def test_token_allocator_pools_hold_exactly_sglangs_pages(report: dict[str, Any]) -> None:
    """Sizes whose slab rounding leaves surplus page ids: still exactly ``size // page_size`` pages, ids
    1..pages (SGLang's, inside its KV buffers), the whole pool handed out once and not one page more;
    ``clear`` frees everything; ``resize`` gives a pool of the new size."""
    r = report["alloc_sizes"]
    for key, size, ps in (("1000/1", 1000, 1), ("2062/4", 2062, 4), ("20816/16", 20816, 16)):
        s = r[key]
        assert s["free_ids_exact"] and s["whole_pool"] and not s["one_more"], (key, s)
        assert s["after_clear"] == size // ps * ps
        assert s["after_resize"] == [size // 2 // ps * ps, size // 2, size // 2 // ps]
    assert all(r[k]["surplus"] > 0 for k in r)  # the rounding case is the one exercised
