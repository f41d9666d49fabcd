"""``hybridkv demo``: the disaggregated run is token-exact against transformers, and a wrong token fails it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.cli.demo import PD_MAX_NEW, PD_MODEL, pd_prompts, reference_tokens
from hybridkv.engine.disagg import PDConfig, PDRank, PDResult, RequestTiming
from hybridkv.engine.random_models import build_random, quiet_transformers


def test_demo_serves_shared_prefix_requests_disaggregated_token_exact(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--out", str(tmp_path), "--requests", "3"]) == 0
    out = capsys.readouterr().out
    assert "3/3 requests token-exact against transformers" in out and "MISMATCH" not in out
    pd = json.loads((tmp_path / "demo.json").read_text())["pd"]
    assert (pd["prefill_pp"], pd["decode_tp"], pd["transport"]) == (2, 2, "shm")
    prompts = pd_prompts(3)
    assert prompts[1][:40] == prompts[2][:40] == prompts[0][:40]  # a shared prefix
    for r, ids in zip(pd["requests"], prompts, strict=True):
        assert r["match"] and r["pd"] == r["transformers"] and len(r["pd"]) == PD_MAX_NEW
        assert r["prompt_tokens"] == len(ids) and r["bytes"] > 0
        t = r["timings"]
        assert t["ttft_s"] == pytest.approx(t["queue_s"] + t["prefill_s"], abs=1e-5) and t["decode_s"] > 0
    assert pd["requests"][0]["bytes"] < pd["requests"][2]["bytes"]  # a longer prompt moves more full-attention KV


def test_demo_exits_1_and_marks_the_one_request_whose_tokens_differ(tmp_path: Path, monkeypatch, capsys) -> None:
    def wrong_second_request(config: PDConfig) -> PDResult:
        with quiet_transformers():
            hf, _ = build_random(PD_MODEL)
            tokens = reference_tokens(hf, [list(p) for p in config.prompts], config.max_new)
        tokens[1][-1] = (tokens[1][-1] + 1) % 256
        n = len(config.prompts)
        rank = PDRank("decode", 0, 0, tuple(map(tuple, tokens)), (1,) * n, (0, 0), (0, 0), 0.0, ((0.0, 0.0),) * n)
        return PDResult(tokens, [rank], [RequestTiming(0.0, 0.1, 0.1, 0.1, 0.1, 0.01)] * n)

    monkeypatch.setattr("hybridkv.engine.disagg.run_pd", wrong_second_request)
    assert main(["demo", "--out", str(tmp_path), "--requests", "3"]) == 1
    out = capsys.readouterr().out
    assert out.count("MISMATCH") == 1 and "2/3 requests token-exact" in out
    pd = json.loads((tmp_path / "demo.json").read_text())["pd"]
    assert [r["match"] for r in pd["requests"]] == [True, False, True]
