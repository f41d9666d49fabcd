"""``hybridkv demo``: the disaggregated run is token-exact against transformers through a killed prefill stage,
and a wrong token or a fault that did not end as intended fails it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.cli.demo import FAULT_REQUEST, PD_MAX_NEW, PD_MODEL, pd_prompts, reference_tokens
from hybridkv.engine.disagg import FAILED, FINISHED, PDConfig, PDResult, RequestResult, RequestTiming
from hybridkv.engine.random_models import build_random, quiet_transformers


def test_demo_recovers_a_request_whose_prefill_stage_was_killed_and_serves_every_request_exactly(
    tmp_path: Path, capsys
) -> None:
    assert main(["demo", "--out", str(tmp_path), "--requests", "3"]) == 0  # mooncake, kill-prefill on request 2
    out = capsys.readouterr().out
    assert "3/3 finished requests token-exact against transformers, 3/3 verdicts right" in out
    assert "MISMATCH" not in out and "recovered, match" in out
    pd = json.loads((tmp_path / "demo.json").read_text())["pd"]
    assert (pd["prefill_pp"], pd["decode_tp"], pd["transport"]) == (2, 2, "mooncake")
    (death,) = pd["deaths"]
    assert death.startswith("prefill stage 1") and "SIGKILL" in death
    prompts = pd_prompts(3)
    assert prompts[1][:40] == prompts[2][:40] == prompts[0][:40]  # a shared prefix
    for i, (r, ids) in enumerate(zip(pd["requests"], prompts, strict=True)):
        assert r["right"] and r["match"] and r["status"] == FINISHED and len(r["pd"]) == PD_MAX_NEW
        assert r["prompt_tokens"] == len(ids) and r["bytes"] > 0
        assert r["attempts"] == (2 if i == FAULT_REQUEST else 1)  # the requests before it were served alone
        t = r["timings"]
        assert t["ttft_s"] == pytest.approx(t["queue_s"] + t["prefill_s"], abs=1e-5) and t["decode_s"] > 0
    assert pd["requests"][1]["cached_tokens"] >= 32  # the shared prefix hit the prefill cache
    assert pd["requests"][0]["bytes"] < pd["requests"][2]["bytes"]  # a longer prompt moves more full-attention KV


def _fake_run_pd(wrong: int | None, failed: int | None):
    """A ``run_pd`` that answers transformers' tokens, except one request's last token and one failed request."""

    def run(config: PDConfig, params: object = None, alone_first: int = 0) -> PDResult:
        with quiet_transformers():
            hf, _ = build_random(PD_MODEL)
            tokens = reference_tokens(hf, [list(p) for p in config.prompts], config.max_new)
        if wrong is not None:
            tokens[wrong][-1] = (tokens[wrong][-1] + 1) % 256
        timing = RequestTiming(0.0, 0.1, 0.1, 0.1, 0.1, 0.01)
        requests = [
            RequestResult(i, [], FAILED, "stalled", None, 0, 0, 1, ())
            if i == failed
            else RequestResult(i, t, FINISHED, "", timing, 0, 100, 1, ())
            for i, t in enumerate(tokens)
        ]
        return PDResult([r.output_ids for r in requests], [], [r.timing for r in requests], requests, [], [], [])

    return run


def test_demo_exits_1_and_marks_the_request_whose_tokens_differ(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("hybridkv.engine.disagg.run_pd", _fake_run_pd(wrong=1, failed=None))
    assert main(["demo", "--out", str(tmp_path), "--requests", "3", "--fault", "none"]) == 1
    out = capsys.readouterr().out
    assert out.count("MISMATCH") == 1 and "2/3 finished requests token-exact" in out
    pd = json.loads((tmp_path / "demo.json").read_text())["pd"]
    assert [r["right"] for r in pd["requests"]] == [True, False, True]


def test_demo_exits_1_when_a_fault_does_not_end_as_intended(tmp_path: Path, monkeypatch, capsys) -> None:
    # the stalled request finished (its transfer was not really held back), and a request failed unasked
    monkeypatch.setattr("hybridkv.engine.disagg.run_pd", _fake_run_pd(wrong=None, failed=0))
    args = ["demo", "--out", str(tmp_path), "--requests", "3", "--fault", "stall-transfer"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "finished, but its transfer was stalled" in out and "request 0 failed: stalled" in out
    pd = json.loads((tmp_path / "demo.json").read_text())["pd"]
    assert [r["right"] for r in pd["requests"]] == [False, True, False]
