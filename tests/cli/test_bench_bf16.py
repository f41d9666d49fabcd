"""``hybridkv bench bf16``: every contender runs the same requests, the bit-equal ones to the baseline's tokens; the
report is complete (no timing is judged here)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hybridkv.cli import app


def test_bench_bf16_reports_both_contenders_token_for_token() -> None:
    args = ["bench", "bf16", "--model", "tiny-gemma3", "--widen", "1", "--rounds", "1", "--workload", "decode-heavy"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    (row,) = report["rows"]
    assert (row["model"], row["workload"], row["requests"]) == ("tiny-gemma3", "decode-heavy", 32)
    assert list(row["contenders"]) == ["baseline", "bit-equal", "unfused", "fast"]
    for contender, c in row["contenders"].items():
        assert c["cpu_s"] > 0 and c["tokens_per_cpu_s"] > 0 and len(c["cpu_rounds"]) == 1
        # paged decode attention and the fused kernels round within bf16, not bit for bit
        assert c["same"] == 32 or contender in ("unfused", "fast")
    assert row["speedup"] > 0 and row["fused_gain"] > 0


def test_bench_bf16_refuses_an_unknown_workload() -> None:
    result = CliRunner().invoke(app, ["bench", "bf16", "--workload", "sideways"])
    assert result.exit_code != 0 and "sideways" in result.output
