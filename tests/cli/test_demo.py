"""``hybridkv demo``: the disaggregated server, driven over HTTP, is token-exact against transformers through a
killed prefill stage; a wrong token, a fault that did not end as intended or memory left held fails it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cli import main
from hybridkv.cli.demo import FAULT_REQUEST, FIGURES, PD_MAX_NEW, PD_MODEL, pd_prompts, reference_tokens
from hybridkv.cli.demo_serve import Served, ServedRun
from hybridkv.engine.random_models import build_random, quiet_transformers


def test_demo_serves_over_http_and_recovers_a_request_whose_prefill_stage_was_killed(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--out", str(tmp_path), "--requests", "3"]) == 0  # mooncake, kill-prefill on request 2
    out = capsys.readouterr().out
    assert "3/3 finished requests token-exact against transformers, 3/3 verdicts right" in out
    assert "MISMATCH" not in out and "recovered, match" in out and "every page and slot back" in out
    pd = json.loads((tmp_path / "demo.json").read_text())["pd"]
    assert (pd["prefill_pp"], pd["decode_tp"], pd["transport"]) == (2, 2, "mooncake")
    assert "--disaggregated" in pd["server"] and "--fault kill-prefill:2:1:5" in pd["server"]
    m = pd["metrics"]  # from the server's /metrics: the kill landed on the prefill engine, which restarted once
    assert (m["worker deaths"], m["prefill engine restarts"], m["decode engine restarts"]) == (1, 1, 0)
    assert m["requests served"] == 3 and m["failed requests"] == 0 and m["failed transfers"] == 0
    assert m["KV + state bytes moved prefill -> decode"] > 0 and m["mean TTFT (s)"] > 0
    assert pd["released"] and m["pages held by requests"] == m["slots held by requests"] == 0
    assert pd["fault"] == {"kind": "kill-prefill", "request": FAULT_REQUEST, "landed": True}
    prompts = pd_prompts(3)
    assert prompts[1][:40] == prompts[2][:40] == prompts[0][:40]  # a shared prefix
    for r, ids in zip(pd["requests"], prompts, strict=True):
        assert r["right"] and r["match"] and r["status"] == "finished" and len(r["pd"]) == PD_MAX_NEW
        assert r["prompt_tokens"] == len(ids) and 0 < r["ttft_s"] <= r["e2e_s"]
    assert pd["requests"][1]["cached_tokens"] >= 32  # served after request 0: the shared prefix hit the prefill cache
    assert m["prompt tokens from the prefill prefix cache"] >= 32


def _fake_serve(wrong: int | None = None, failed: int | None = None, **figures: float):
    """A ``serve_requests`` that answers transformers' tokens, except one request's last token and one failed
    request, with /metrics figures ``figures`` (by their demo label; the rest: what a clean run shows)."""

    def serve(model_dir: str, prompts: list[list[int]], max_new: int, *args: Any, **kwargs: Any) -> ServedRun:
        with quiet_transformers():
            hf, _ = build_random(PD_MODEL)
            tokens = reference_tokens(hf, prompts, max_new)
        if wrong is not None:
            tokens[wrong][-1] = (tokens[wrong][-1] + 1) % 256
        requests = [
            Served([], "error", "stalled", 0, None, 0.2) if i == failed else Served(t, "length", "", 0, 0.1, 0.2)
            for i, t in enumerate(tokens)
        ]
        labels = {
            "worker deaths": 0,
            "prefill engine restarts": 0,
            "decode engine restarts": 0,
            "pages held by requests": 0,
            "slots held by requests": 0,
            **figures,
        }
        metrics = {series: float(labels.get(label, 1)) for label, series in FIGURES.items()}
        return ServedRun(requests, metrics, 1.0)

    return serve


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, serve: Any) -> tuple[int, dict[str, Any]]:
    monkeypatch.setattr("hybridkv.cli.demo_serve.serve_requests", serve)
    code = main(["demo", "--out", str(tmp_path), "--requests", "3", "--fault", fault])
    return code, json.loads((tmp_path / "demo.json").read_text())["pd"]


def test_demo_exits_1_and_marks_the_request_whose_tokens_differ(tmp_path: Path, monkeypatch, capsys) -> None:
    code, pd = _run(tmp_path, monkeypatch, "none", _fake_serve(wrong=1))
    out = capsys.readouterr().out
    assert code == 1 and out.count("MISMATCH") == 1 and "2/3 finished requests token-exact" in out
    assert [r["right"] for r in pd["requests"]] == [True, False, True]


def test_demo_exits_1_when_a_fault_does_not_end_as_intended(tmp_path: Path, monkeypatch, capsys) -> None:
    # the stalled request finished (its transfer was not really held back), and a request failed unasked
    code, pd = _run(tmp_path, monkeypatch, "stall-transfer", _fake_serve(failed=0))
    out = capsys.readouterr().out
    assert code == 1 and "finished, but its transfer was stalled" in out and "request 0 failed: stalled" in out
    assert [r["right"] for r in pd["requests"]] == [False, True, False]


def test_demo_exits_1_when_a_kill_did_not_land(tmp_path: Path, monkeypatch, capsys) -> None:
    # every token right, but /metrics show no prefill worker died: the fault did not happen
    code, pd = _run(tmp_path, monkeypatch, "kill-prefill", _fake_serve())
    out = capsys.readouterr().out
    assert code == 1 and "the fault did not land as intended (0 worker deaths, 0 prefill restarts)" in out
    assert [r["right"] for r in pd["requests"]] == [True, True, False] and not pd["fault"]["landed"]
    # the same run where the kill landed is right
    code, pd = _run(
        tmp_path, monkeypatch, "kill-prefill", _fake_serve(**{"worker deaths": 1, "prefill engine restarts": 1})
    )
    assert code == 0 and all(r["right"] for r in pd["requests"])


def test_demo_exits_1_when_a_worker_still_holds_memory(tmp_path: Path, monkeypatch, capsys) -> None:
    code, pd = _run(tmp_path, monkeypatch, "none", _fake_serve(**{"pages held by requests": 3}))
    out = capsys.readouterr().out
    assert code == 1 and all(r["right"] for r in pd["requests"]) and not pd["released"]
    assert "NOT every page and slot back" in out
