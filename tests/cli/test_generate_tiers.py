"""``hybridkv generate`` with tiers below the device: a prefix the device evicted comes back from host
memory, or from the Mooncake Store when host memory is tiny, with the tokens of transformers'
generate; a loopback master started for ``--store mooncake`` is stopped; bad tier options are
one ``error:`` line, exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hybridkv.cli import main
from tests.engine.harness import hf_reference, prompt

SHARED = prompt(950, 40)
PROMPTS = [SHARED + prompt(960, 8)] + [prompt(970 + i, 60) for i in range(30)] + [SHARED + prompt(990, 5)]
ARGS = ["generate", "--random", "tiny-gemma3", "--page-size", "4", "--chunk-size", "8", "--gpu-memory", "300000"]
ARGS += ["--max-new-tokens", "4"]


def _children(name: str) -> list[int]:
    """Pids of this process's children running ``name``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if comm == name[:15] and int(rest[1]) == os.getpid():
            out.append(int(stat.parent.name))
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiers") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    return path


BELOW = [(["--host-memory", "8MiB"], "host"), (["--host-memory", "16KiB", "--store", "mooncake"], "storage")]


@pytest.mark.parametrize(("tiers", "where"), BELOW)
def test_an_evicted_prefix_comes_back_from_below(tiers, where, prompts_file, capsys) -> None:
    before = set(_children("mooncake_master"))  # the test session's own master, if one runs
    assert main([*ARGS, "--prompts", str(prompts_file), *tiers, "--json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    outs = report["requests"]
    assert [o["output_ids"] for o in outs] == [hf_reference("tiny-gemma3", tuple(p), 4)[0] for p in PROMPTS]
    assert outs[-1]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0, where: 40}
    assert report["totals"]["cached_tokens_details"][where] == 40
    assert set(_children("mooncake_master")) <= before  # a master started for --store mooncake is gone


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        (["--store", "disk"], "--store takes none or mooncake"),
        (["--store-master", "127.0.0.1:5"], "it needs --store mooncake"),
        (["--store", "mooncake", "--store-master", "nohost"], "host:port"),
        (["--host-memory", "0"], "more than 0 B"),
        (["--store", "mooncake", "--store-memory", "1MiB"], "at least 16MiB"),
        (["--host-memory", "1MiB", "--no-prefix-cache"], "drop --no-prefix-cache"),
        (["--store", "mooncake", "--store-master", "127.0.0.1:9"], "cannot set up a Mooncake Store client"),
    ],
)
def test_bad_tier_options_are_one_error_line(tiers, message, prompts_file, capsys) -> None:
    assert main([*ARGS, "--prompts", str(prompts_file), *tiers]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
