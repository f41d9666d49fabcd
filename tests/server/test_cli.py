"""``hybridkv serve`` refuses bad options with one ``error:`` line and exit 2, before loading a model."""

from __future__ import annotations

import socket

import pytest

from hybridkv.cli import main


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "give exactly one of --model DIR and --random NAME"),
        (["--random", "tiny-nothing"], "not a tiny random model"),
        (["--random", "tiny-qwen3-next", "--port", "70000"], "--port"),
        (["--random", "tiny-qwen3-next", "--gpu-memory", "lots"], "--gpu-memory"),
        (["--random", "tiny-qwen3-next", "--shutdown-timeout", "nan"], "--shutdown-timeout"),
        (["--random", "tiny-qwen3-next", "--tokenizer", "/nonexistent"], "--tokenizer"),
        (["--random", "tiny-qwen3-next", "--max-header", "100"], "at least 1 KiB"),
        (["--random", "tiny-qwen3-next", "--max-header", "lots"], "--max-header"),
        (["--random", "tiny-qwen3-next", "--header-timeout", "0"], "--header-timeout"),
        (["--random", "tiny-qwen3-next", "--max-connections", "0"], "--max-connections"),
        (
            ["--random", "tiny-qwen3-next", "--decode-tp", "2"],
            "--decode-tp configures the PD server: add --disaggregated",
        ),
        (["--random", "tiny-qwen3-next", "--disaggregated", "--transport", "pigeon"], "unknown transport 'pigeon'"),
        (["--random", "tiny-qwen3-next", "--disaggregated", "--fault", "explode:1"], "unknown fault 'explode'"),
        (["--random", "tiny-qwen3-next", "--disaggregated", "--fault", "kill-decode:x"], "'kill-decode:x'"),
        # refused by the layout check, before any process starts
        (["--random", "tiny-qwen3-next", "--disaggregated", "--fault", "kill-decode:0:5"], "rank 5 does not exist"),
        (["--random", "tiny-qwen3-next", "--disaggregated", "--prefill-pp", "64"], "64"),
    ],
)
def test_bad_options_are_one_error_line(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err


def test_a_taken_port_fails_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--random", "tiny-qwen3-next", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
