"""The CLI's one error path: user errors print one line ``error: ...`` and exit 2.

The table grows with every command; each row is an input a careless user (or a script)
could pass. ``--debug`` re-raises instead, so a developer still gets the traceback.
"""

from __future__ import annotations

import pytest

from hybridkv.cli import main

BAD_INPUTS = [
    (["plan", "--model", "no-such-model", "--gpu-memory", "80GiB"], "no preset named"),
    (["plan", "--model", "Llama-3.1-8B", "--gpu-memory", "abc"], "cannot read 'abc'"),
    (["plan", "--model", "Llama-3.1-8B", "--tp", "0"], "--tp"),
    (["plan", "--model", "Llama-3.1-8B", "--gpu-memory", "0"], "more than 0 B"),
    (["plan", "--model", "Llama-3.1-8B", "--gpu-memory", "-1GiB"], "cannot read"),
    (["plan", "--model", "Llama-3.1-8B", "--context", "0"], "--context"),
    (["plan", "--model", "Llama-3.1-8B", "--page-size", "x"], "--page-size"),
    (["plan", "--bogus"], "No such option"),
    (["no-such-command"], "No such command"),
    (["replay", "--trace", "/nonexistent.jsonl", "--model", "Llama-3.1-8B", "--gpu-memory", "40GiB"], "neither"),
    (["replay", "--trace", "README.md", "--model", "Llama-3.1-8B", "--gpu-memory", "40GiB"], "trace format"),
]
REPLAY = ["replay", "--trace", "mooncake-conversation", "--model", "Llama-3.1-8B", "--gpu-memory", "40GiB"]
BAD_INPUTS += [
    ([*REPLAY, "--max-running", "0"], "--max-running"),
    ([*REPLAY, "--max-running", "-1"], "--max-running"),
    ([*REPLAY, "--decode-step-ms", "nan"], "--decode-step-ms"),
    ([*REPLAY, "--prefill-tps", "-5"], "--prefill-tps"),
    ([*REPLAY, "--limit", "0"], "--limit"),
    ([*REPLAY, "--page-size", "0"], "--page-size"),
    ([*REPLAY[:-1], "100000TiB"], "at most"),
    (["bench", "engine", "--model", "tiny-llama"], "unknown models ['tiny-llama']"),
    (["bench", "engine", "--requests", "0"], "--requests"),
    (["bench", "engine", "--widen", "0"], "--widen"),
    (["bench", "engine", "--dtype", "int8"], "not a dtype this engine serves"),
    (["bench", "engine", "--widen", "65"], "--widen"),
    (["bench", "engine", "--block-tokens", "0"], "--block-tokens"),
]

# transfer-plan, pd-demo, bench transfer (issue 9 items 15-17): ranges checked before any work
BAD_INPUTS += [
    (["transfer-plan", "--model", "tiny-dense", "--decode-tp", "0"], "--decode-tp"),
    (["transfer-plan", "--model", "tiny-dense", "--prefill-tp", "0"], "--prefill-tp"),
    (["transfer-plan", "--model", "tiny-dense", "--seq-len", "-5"], "--seq-len"),
    (["transfer-plan", "--model", "tiny-dense", "--seq-len", "100000000"], "at most 131072 pages"),
    (["transfer-plan", "--model", "tiny-dense", "--page-size", "0"], "--page-size"),
    (["transfer-plan", "--model", "tiny-dense", "--prefill-pp", "8"], "exceeds the model's 4 layers"),
    (["transfer-plan", "--model", "tiny-dense", "--decode-tp", "3"], "cannot be split evenly over TP 3"),
    (["transfer-plan", "--model", "no-such-model"], "no preset named"),
    (["pd-demo", "--requests", "0"], "--requests"),
    (["pd-demo", "--requests", "1000"], "--requests"),
    (["pd-demo", "--decode-tp", "0"], "--decode-tp"),
    (["pd-demo", "--transport", "nixl"], "unknown transport 'nixl'; known: shm, mooncake"),
    (["pd-demo", "--fault", "bogus"], "unknown fault 'bogus'"),
    (["bench", "transfer", "--reps", "0"], "--reps"),
    (["bench", "transfer", "--batch", "0"], "--batch"),
    (["bench", "transfer", "--transport", "nixl"], "unknown transport"),
    (["bench", "memory", "--device", "tpu"], "'tpu' is not a device here; use one of meta, cpu, cuda"),
    (["bench", "engine", "--device", "meta"], "'meta' is not a device here; use one of cpu, cuda"),
]

# serve-pd (issue 11): ranges, transport and files refused before any process starts
SERVE_PD = ["serve-pd", "--random", "tiny-qwen3-next", "--prompts", "README.md"]
BAD_INPUTS += [
    (["serve-pd", "--random", "tiny-qwen3-next", "--prompts", "/nonexistent.jsonl"], "--prompts"),
    ([*SERVE_PD, "--prefill-pp", "0"], "--prefill-pp"),
    ([*SERVE_PD, "--decode-tp", "0"], "--decode-tp"),
    ([*SERVE_PD, "--max-new-tokens", "0"], "--max-new-tokens"),
    ([*SERVE_PD, "--prefill-tp", "0"], "--prefill-tp"),
    ([*SERVE_PD, "--decode-page-size", "0"], "--decode-page-size"),
    ([*SERVE_PD, "--transport", "nixl"], "unknown transport 'nixl'"),
    ([*SERVE_PD, "--random", "tiny-nope"], "not a tiny random model"),
    (SERVE_PD, "not a prompt line"),
    (["bench", "pd", "--requests", "0"], "--requests"),
    (["bench", "pd", "--decode-tp", "0"], "--decode-tp"),
    (["bench", "pd", "--model", "tiny-nope"], "not a tiny random model"),
    (["bench", "pd", "--prefill-tp", "0"], "--prefill-tp"),
    (["bench", "pd", "--transport", "nixl"], "unknown transport 'nixl'"),
    (["bench", "pd", "--dtype", "float64"], "not a dtype this engine serves"),
    (["demo", "--requests", "2"], "--requests"),
    (["demo", "--requests", "7"], "--requests"),
    (["demo", "--fault", "bogus"], "unknown fault 'bogus'; choose one of kill-prefill"),
    (["demo", "--transport", "nixl"], "unknown transport 'nixl'"),
]

# vllm-pd-proxy: URLs and the port checked before anything listens
BAD_INPUTS += [
    (["vllm-pd-proxy", "--prefill", "localhost:8100", "--decode", "http://h:1"], "prefill server's URL"),
    (["vllm-pd-proxy", "--prefill", "http://h:1", "--decode", "ftp://h:2"], "decode server's URL"),
    (["vllm-pd-proxy", "--prefill", "http://h:1", "--decode", "http://h:2", "--port", "70000"], "--port"),
]

GOOD_ROW = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
BAD_TRACES = {
    "empty.jsonl": ("", "no requests"),
    "binary.jsonl": ("\x00\xff garbage", "bad request record"),
    "schema.jsonl": ('{"ts": 1}', "bad request record"),
    "nan.jsonl": ('{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "bad request"),
    "fraction.jsonl": ('{"timestamp": 0, "input_length": 5.5, "output_length": 1, "hash_ids": [1]}', "bad request"),
    "negative.jsonl": ('{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [1]}', "bad request"),
    "zero.jsonl": ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}', "bad request"),
    "huge.jsonl": ('{"timestamp": 0, "input_length": 5, "output_length": 1000000000000, "hash_ids": [1]}', "bad"),
    "blocks.jsonl": ('{"timestamp": 0, "input_length": 900, "output_length": 1, "hash_ids": [1]}', "exceeds"),
}


@pytest.mark.parametrize(("args", "says"), BAD_INPUTS, ids=[" ".join(a)[:60] for a, _ in BAD_INPUTS])
def test_bad_input_is_one_error_line_and_exit_2(args, says, capsys):
    assert main(args) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert says in lines[0]
    assert "Traceback" not in out + err


@pytest.mark.parametrize("name", sorted(BAD_TRACES))
def test_bad_trace_is_one_error_line_and_exit_2(name, tmp_path, capsys):
    text, says = BAD_TRACES[name]
    path = tmp_path / name
    path.write_text(GOOD_ROW + "\n" + text + "\n" if name != "empty.jsonl" else "")
    assert main(["replay", "--trace", str(path), "--model", "Llama-3.1-8B", "--gpu-memory", "40GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_truncated_gzip_trace_is_one_error_line(tmp_path, capsys):
    import gzip

    data = gzip.compress(((GOOD_ROW + "\n") * 200).encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    assert main(["replay", "--trace", str(path), "--model", "Llama-3.1-8B", "--gpu-memory", "40GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be read" in err[0], err


def test_debug_flag_shows_the_exception():
    with pytest.raises(ValueError, match="exceeds the model's 4 layers"):
        main(["transfer-plan", "--model", "tiny-dense", "--prefill-pp", "8", "--debug"])


def test_no_arguments_prints_help_only(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert "Usage" in out + err and "error:" not in out + err


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--prefill-pp", "9"], "PP size 9 exceeds the model's 4 layers"),
        (["--decode-tp", "3"], "not divisible by TP size 3"),
        (["--prefill-tp", "3"], "not divisible by TP size 3"),
        (["--page-size", "4", "--decode-page-size", "8"], "page size"),
        (["--max-context", "8"], "exceeds --max-context 8"),
        (["--prompts", "BAD"], "outside the vocabulary"),
    ],
)
def test_serve_pd_refuses_a_layout_or_prompt_before_starting_processes(extra, says, tmp_path, capsys):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"prompt_ids": [5, 6, 7, 8]}\n')
    bad.write_text('{"prompt_ids": [5, 6]}\n{"prompt_ids": [5, 100000]}\n')
    extra = [str(bad) if a == "BAD" else a for a in extra]
    assert main(["serve-pd", "--random", "tiny-qwen3-next", "--prompts", str(good), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
