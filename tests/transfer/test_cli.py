"""``hybridkv transfer-plan`` and ``hybridkv bench transfer`` run and report consistently."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app, main
from hybridkv.transfer.transport import TRANSPORTS, ShmTransport, Transport

runner = CliRunner()


def test_transfer_plan_covers_every_decode_byte_once():
    args = ["transfer-plan", "--model", "tiny-swa2-state", "--prefill-pp", "2", "--prefill-tp", "2"]
    result = runner.invoke(app, [*args, "--decode-tp", "4", "--seq-len", "30", "--page-size", "4", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    per_decode: dict[int, int] = {}
    for leg in report["legs"]:
        per_decode[leg["decode_tp"]] = per_decode.get(leg["decode_tp"], 0) + leg["bytes"]
        assert leg["ops"] <= leg["pieces"]
    assert sorted(per_decode) == [0, 1, 2, 3]
    assert len(set(per_decode.values())) == 1  # every decode rank gets the same amount


def test_transfer_plan_explains_an_impossible_layout(capsys):
    exit_code = main(["transfer-plan", "--model", "tiny-dense", "--decode-tp", "3"])  # the CLI's one error path
    assert exit_code == 2
    assert "cannot be split evenly over TP 3" in capsys.readouterr().err


def test_bench_transfer_runs_and_reports_ratios():
    args = ["bench", "transfer", "--json", "--reps", "1", "--page-tokens", "4", "--batch", "4"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    (case,) = report["cases"]
    assert case["page_bytes"] == 64 << 10 and case["batch"] == 4 and case["bytes"] == 4 * (64 << 10)
    assert case["hybridkv_gbps"] > 0 and case["baseline_gbps"] > 0 and case["ratio"] > 0
    assert 0 < case["plan_us"] < case["overhead_us"] + 1e6 * case["bytes"] / (case["hybridkv_gbps"] * 1e9)
    assert case["prepare_us"] > 0 and case["unprepared_plan_us"] > 0  # the prepared part is reported too
    # the verdict follows from the case's own figures (a case too small for the goal is not judged)
    assert case["meets_goal"] == (None if case["goal"] is None else case["ratio"] >= case["goal"])
    assert report["meets_goal"] == case["meets_goal"]


def test_each_transport_declares_its_bench_goal_and_one_without_is_benched_with_no_baseline(monkeypatch):
    goals = {name: kind.bench_goal for name, kind in TRANSPORTS.items()}
    assert {n: (g.ratio, g.from_page_bytes, g.copy_bound) for n, g in goals.items() if g} == {
        "shm": (0.8, 64 << 10, True),
        "mooncake": (0.9, 0, False),
    }
    monkeypatch.setattr(ShmTransport, "bench_goal", None)  # as a transport with no raw baseline declares
    args = ["bench", "transfer", "--json", "--reps", "1", "--page-tokens", "4", "--batch", "2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["baseline"] == "none: the shm transport declares no raw baseline (Transport.bench_goal is None)"
    assert report["goal"] is None and report["meets_goal"] is None
    (case,) = report["cases"]
    assert case["hybridkv_gbps"] > 0 and case["end_to_end_gbps"] > 0
    assert {k for k, v in case.items() if v is None} == {
        *("baseline_gbps", "ratio", "overhead_us", "memcpy_block_gbps", "ratio_to_block", "goal", "meets_goal"),
    }
    table = runner.invoke(app, args[:2] + args[3:])
    assert table.exit_code == 0 and "goal: none (baseline: none: the shm transport" in table.output, table.output
    with pytest.raises(NotImplementedError, match="the shm transport has no raw baseline: its bench_goal is None"):
        Transport.raw_write(ShmTransport(), "shm:x:1:1", [], [], [])  # the default a transport with no goal keeps


def test_pd_demo_moves_every_byte_and_fails_only_the_faulty_requests():
    """Two prefill stage processes -> decode TP 2 over shm; both faults; JSON report."""
    result = runner.invoke(app, ["pd-demo", "--model", "tiny-gdn", "--requests", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and all(c["ok"] for c in report["checks"])
    assert report["prefill"] == {"pp": 2, "tp": 1, "processes": 2} and report["decode"] == {"tp": 2}
    good = [r for r in report["requests"] if not r["fault"]]
    assert len(good) == 4  # 2 requests x 2 decode TP ranks
    for r in good:
        labels = [label for label, _ in r["timeline_ms"]]
        assert labels == ["Bootstrapping", "WaitingForInput", "Transferring", "Success"], r
        assert r["bytes"] > 0 and r["ops"] > 0 and r["gbps"] > 0
    faulty = {r["fault"]: r for r in report["requests"] if r["fault"]}
    assert faulty["slot-size"]["phase"] == "Failed" and "state slot size mismatch" in faulty["slot-size"]["reason"]
    assert faulty["seq-len"]["phase"] == "Failed" and "seq_len mismatch" in faulty["seq-len"]["reason"]
    assert report["bytes_verified"] == sum(r["bytes"] for r in good)
    assert {p["phase"] for p in report["prefill_reports"] if "bad" not in p["id"]} == {"Success"}
