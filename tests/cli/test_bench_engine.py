"""``hybridkv bench engine``: its workload keeps the trace's shared prefixes; its report is exact and complete."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hybridkv.bench.engine import CallTimer, conversation_prompts
from hybridkv.cli import app


def test_conversation_prompts_share_the_trace_blocks_as_token_prefixes() -> None:
    prompts = conversation_prompts(64, 4)
    assert len(prompts) == 64 and all(len(p) % 4 == 0 and min(p) >= 3 and max(p) < 256 for p in prompts)
    assert min(map(len, prompts)) >= 8 and max(map(len, prompts)) <= 64 * 4
    assert prompts == conversation_prompts(64, 4)  # deterministic
    # later turns of a conversation extend an earlier request: a prefix of >= 2 blocks is shared
    shared = [p for i, p in enumerate(prompts) if any(q[:8] == p[:8] for q in prompts[:i])]
    assert len(shared) >= 32
    assert {tuple(p[:4]) for p in prompts} == {tuple(prompts[0][:4])}  # block 0: the system prompt


def test_call_timer_counts_outermost_calls_only() -> None:
    class Inner:
        def outer(self) -> int:
            return self.inner() + self.inner()

        def inner(self) -> int:
            return 1

    timer = CallTimer()
    with timer.patch(Inner):
        assert Inner().outer() == 2
        assert Inner().inner() == 1
    assert timer.calls == 2 and timer.seconds > 0
    assert "timed" not in repr(Inner.outer)  # restored


def test_bench_engine_json_is_exact_and_reports_both_goals() -> None:
    args = ["bench", "engine", "--model", "tiny-qwen3-next", "--requests", "6", "--max-new-tokens", "3", "--json"]
    args += ["--chunk-size", "8", "--page-size", "4"]  # small chunks: later requests start after earlier ones cached
    # ... the chunks of an earlier request still in prefill: the engine's default checkpoints every chunk for them
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert result.stderr.startswith("hybridkv bench engine: max context "), result.stderr  # sizing, at start
    (row,) = report["models"]
    assert row["model"] == "tiny-qwen3-next" and row["exact"] == 6 and row["tokens"] == 18
    assert 0 < row["hybridkv_share"] < 1 and row["hybridkv_calls"] > row["steps"] > 0
    assert row["speedup"] > 0 and isinstance(row["speedup_met"], bool) and isinstance(row["share_met"], bool)
    assert row["prefix_cache"] and 0 < row["prefix_hit_rate"] < 1 and row["cached_tokens"] > 0
    assert report["checkpoints"] == "interval:8,prompt-aligned,branch,end"  # the default, resolved
