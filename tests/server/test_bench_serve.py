"""``hybridkv bench serve``: real ``hybridkv serve`` subprocesses (single-process and ``--disaggregated``) against
the engine, same requests, exact."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridkv.bench.serve import _decoding, arrivals
from hybridkv.bench.server_cpu import ServerCpu, used_between
from hybridkv.bench.socket_wake import send_wake_us
from hybridkv.cli import app, main
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import build_random
from hybridkv.server.run import bind


def test_arrivals_are_seeded_poisson_offsets() -> None:
    a = arrivals(200, 10.0, seed=3)
    assert a[0] == 0.0 and a == sorted(a) and a == arrivals(200, 10.0, seed=3)
    assert 10 < a[-1] < 30  # ~ 199 gaps of 0.1 s
    assert arrivals(4, math.inf, 0) == [0.0] * 4


def test_used_between_takes_the_scrapes_share_out() -> None:
    before, after = ServerCpu(1.0, 2.0, 3.0, 0.5), ServerCpu(1.5, 2.25, 3.5, 0.75)
    assert used_between(before, after) == ServerCpu(0.5, 0.25, 0.5, 0.25)
    assert used_between(before, after, ServerCpu(0.0, 0.125, 0.25, 0.0)) == ServerCpu(0.5, 0.125, 0.25, 0.25)


def _children() -> list[str]:
    """Command lines of this process's children (every thread's)."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    pids = [p for t in tasks.iterdir() for p in (t / "children").read_text().split()]
    found = []
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
    return found


def test_send_wake_us_times_every_send_and_leaves_no_reader_behind() -> None:
    spent = send_wake_us(count=20, scratch=1 << 16)
    assert len(spent) == 20 and min(spent) >= 0 and sum(spent) > 0  # a send's CPU: never negative, not all zero
    assert not [c for c in _children() if "create_connection" in c]  # the reader ended with the connection
    with pytest.raises(ValueError, match="count 0"):
        send_wake_us(count=0)


def test_send_wake_us_runs_the_given_work_before_each_send() -> None:
    calls: list[int] = []
    spent = send_wake_us(count=5, between=lambda: calls.append(len(calls)))
    assert len(spent) == 5 and calls == [0, 1, 2, 3, 4]


def test_the_send_probe_steps_a_decoding_engine_and_leaves_it_idle() -> None:
    weights, config = build_random("tiny-qwen3-next")
    engine = Engine(config, weights)
    with _decoding(engine, [5, 6, 7], 8) as step:
        for _ in range(12):  # past one request's 8 tokens: the next one is submitted (and prefilled) then
            step()
        assert engine.has_work() and engine.stats["steps"] == 12
    assert not engine.has_work() and engine.stats["aborted"] == 1  # the second request, aborted on exit
    engine.clear_cache()
    assert engine.metrics()["live_pages"] == 0 and engine.metrics()["live_slots"] == 0  # every page and slot back
    assert [len(o.output_ids) for o in engine.generate([[5, 6, 7]], 3, stop_at_eos=False)] == [3]  # it serves on


def test_listening_socket_is_tcp_with_nodelay() -> None:
    sock = bind("127.0.0.1", 0)  # without TCP_NODELAY every response waited for a delayed ACK (~40 ms)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()


def test_bench_serve_json_is_exact_and_complete() -> None:
    args = ["bench", "serve", "--requests", "6", "--max-new-tokens", "3", "--rounds", "1", "--alone", "2"]
    args += ["--gpu-memory", "32MiB", "--disaggregated", "--prefill-pp", "2", "--decode-tp", "2", "--compare-writes"]
    args += ["--dtype", "bfloat16"]  # the engine and every server it starts in bf16
    result = CliRunner().invoke(app, [*args, "--max-step-tokens", "96", "--request-rate", "inf", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["dtype"] == "bfloat16"
    assert report["max_step_tokens"] == 96  # the engine's, and every server's (--max-step-tokens passed on)
    # one sizing story (cli/sizing.py): the context from the work, the budget per process of either server
    assert result.stderr.startswith("hybridkv bench serve: max context "), result.stderr
    assert "longest prompt" in result.stderr and "--gpu-memory 32.00 MiB per process" in result.stderr
    (row,) = report["per_round"]
    assert row["exact"] == 6  # every HTTP request gave the engine's tokens
    assert row["pd_exact"] == 6  # and every request of the disaggregated server
    assert report["disaggregated"] == "--disaggregated --prefill-pp 2 --prefill-tp 1 --decode-tp 2 --transport shm"
    assert row["pd"]["cpu_s"] is None
    for side in ("engine", "http", "pd"):
        s = row[side]
        assert s["ttft_ms"]["p50"] > 0 and s["e2e_ms"]["p99"] >= s["e2e_ms"]["p50"]
        assert s["output_tokens_per_s"] > 0 and 0 <= s["prefix_hit_rate"] < 1
    assert report["alone"] == 2 and report["overhead_ms"]["p50"] is not None
    for key in ("overhead_steady_ms", "overhead_plain_ms", "overhead_plain_steady_ms"):
        assert report[key]["p50"] is not None, key  # the plain ones: the same requests, tokens checked too
    assert report["goal_met"] == (report["overhead_steady_ms"]["p50"] <= report["goal_overhead_ms"])
    # the endpoints side by side (tokens checked equal inside): each one's e2e, and the two p50 ratios
    ends = report["endpoints"]
    assert set(ends["e2e_ms"]) == {"generate", "completions", "completions_logprobs"}
    assert all(e2e["p50"] > 0 for e2e in ends["e2e_ms"].values())
    assert ends["completions_to_generate"] > 0 and ends["logprobs_to_plain"] > 0
    # CPU from the server's /metrics (process CPU counts 10 ms ticks: over 2 requests only the sign is noise)
    assert report["http_cpu_ms"] > 0 and isinstance(report["server_other_cpu_ms"], float)  # the loop's clock is exact
    assert report["client_cpu_ms"] > 0  # the client streamed every chunk of 2 requests
    assert report["engine_thread_cpu_ms"] > 0 < report["engine_cpu_ms"]
    # the server's engine thread wrote the chunks (not --loop-writes): that CPU is counted, and it is serving
    assert report["loop_writes"] is False and 0 < report["stream_write_cpu_ms"] < report["engine_thread_cpu_ms"]
    # side by side, the same requests: a --loop-writes server, whose engine thread writes nothing
    other = report["other_writes"]
    assert other["loop_writes"] is True and other["stream_write_cpu_ms"] == 0 < other["http_cpu_ms"]
    assert other["overhead_steady_ms"]["p50"] is not None and other["engine_cpu_ms"] == report["engine_cpu_ms"]
    assert row["http"]["engine_thread_cpu_s"] > 0 and row["http"]["cpu_s"] > 0
    # what two back-to-back scrapes find is measured on each server and taken out of its requests' figures
    for figures in (report, other):
        assert figures["scrape_cpu_ms"]["loop"] > 0 and figures["scrape_cpu_ms"]["engine_thread"] >= 0
    # the floor of a streamed chunk on this machine, measured in the same run
    assert 0 < report["send_wake_us"]["p50"] <= report["send_wake_us"]["p99"]
    assert 0 < report["send_after_step_us"]["p50"] <= report["send_after_step_us"]["p99"]


@pytest.mark.parametrize("option", ["--disaggregated", "--compare-writes"])
def test_bench_serve_refuses_url_with_a_server_it_starts(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1", option]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"--url loads a running server; {option} starts its own" in err
