"""Replay input errors (issue 19 item 7): a trace row the replay cannot serve is one ``error:``
line naming the row and the field, exit 2. Before: a radix row whose ``sys_id`` names no
system prompt ended in "internal error IndexError" (exit 1), ids of 10**30 in a raw "Python int
too large" message, and a Mooncake hash id whose token ids overflow int64 replayed silently
with wrapped ids."""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

import pytest

from hybridkv.cli import main
from hybridkv.traces import load_peer_trace

REPLAY = ["--model", "Llama-3.1-8B", "--gpu-memory", "40GiB"]


@cache
def _small_peer() -> dict[str, Any]:
    """The peer trace cut to a few first turns (all system prompts kept)."""
    data = load_peer_trace()
    first_turns = [r for r in data["radix"]["requests"] if r["turn"] == 0][:3]
    alloc = {"requests": data["alloc"]["requests"][:2], "events": [], "peak_live_tokens": 0, "peak_live_pages": 0}
    return {"alloc": alloc, "radix": {"system_prompts": data["radix"]["system_prompts"], "requests": first_turns}}


def _radix(tmp_path, change) -> str:
    data = copy.deepcopy(_small_peer())
    change(data["radix"])
    path = tmp_path / "peer.json"
    path.write_text(json.dumps(data))
    return str(path)


def _error_line(args: list[str], capsys) -> str:
    assert main(["replay", *args, *REPLAY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "internal error" not in err[0] and "Python int too large" not in err[0], err[0]
    return err[0]


def test_the_small_trace_replays(tmp_path, capsys):
    assert main(["replay", "--trace", _radix(tmp_path, lambda r: None), *REPLAY, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["requests"] == 3


RADIX_CASES = {
    "sys_id": (lambda r: r["requests"][1].update(sys_id=len(r["system_prompts"])), "sys_id"),
    "user_ids": (lambda r: r["requests"][1]["user_ids"].__setitem__(0, 10**30), "user_ids"),
    "negative": (lambda r: r["requests"][1]["output_ids"].__setitem__(2, -7), "output_ids"),
    "system_prompt": (lambda r: r["system_prompts"][5].__setitem__(0, 10**30), "system_prompts[5]"),
}


@pytest.mark.parametrize("case", sorted(RADIX_CASES))
def test_a_bad_radix_row_names_the_row_and_the_field(case, tmp_path, capsys):
    change, field = RADIX_CASES[case]
    line = _error_line(["--trace", _radix(tmp_path, change)], capsys)
    assert field in line
    if case != "system_prompt":
        rid = _small_peer()["radix"]["requests"][1]["rid"]
        assert f"rid {rid}" in line, line


@pytest.mark.parametrize("hash_id", [10**30, 2**64 - 1, 2**55, 2**31])
def test_a_mooncake_hash_id_beyond_the_id_space_names_the_line_and_field(hash_id, tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
    bad = f'{{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [3, {hash_id}]}}'
    path.write_text(f"{good}\n{bad}\n")
    line = _error_line(["--trace", str(path)], capsys)
    assert f"{path}:2" in line and "hash_ids" in line, line
