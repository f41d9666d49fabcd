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
    (["plan", "--model", "Llama-3.1-8B", "--tp", "0"], "TP and PP sizes"),
    (["plan", "--model", "Llama-3.1-8B", "--page-size", "x"], "--page-size"),
    (["plan", "--bogus"], "No such option"),
    (["no-such-command"], "No such command"),
    (["replay", "--trace", "/nonexistent.jsonl", "--model", "Llama-3.1-8B", "--gpu-memory", "40GiB"], "neither"),
    (["replay", "--trace", "README.md", "--model", "Llama-3.1-8B", "--gpu-memory", "40GiB"], "trace format"),
]


@pytest.mark.parametrize(("args", "says"), BAD_INPUTS, ids=[" ".join(a)[:60] for a, _ in BAD_INPUTS])
def test_bad_input_is_one_error_line_and_exit_2(args, says, capsys):
    assert main(args) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert says in lines[0]
    assert "Traceback" not in out + err


def test_debug_flag_shows_the_exception():
    with pytest.raises(ValueError, match="no preset named"):
        main(["plan", "--model", "no-such-model", "--debug"])


def test_no_arguments_prints_help_only(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert "Usage" in out + err and "error:" not in out + err
