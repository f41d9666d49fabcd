"""A usage error is answered before torch loads (torch alone takes seconds on a cold, busy machine).

One subprocess runs every bad command line below through ``main`` and reports, after each, the exit
status, the error line and whether ``torch`` has been imported; a command module or option callback
that imports the library too early makes its row fail.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from hybridkv.catalogue import TINY_PRESETS, PresetError, preset_names, resolve_preset
from hybridkv.cli.app import LIBRARY_USER_ERRORS

BAD_COMMAND_LINES = [
    (["plan", "--model", "no-such-model", "--gpu-memory", "80GiB"], "no preset named 'no-such-model'"),
    (["plan", "--model", "Llama-3.1-8B", "--gpu-memory", "abc"], "cannot read 'abc'"),
    (["transfer-plan", "--model", "no-such-model"], "no preset named"),
    (["replay", "--trace", "peer", "--model", "tiny", "--gpu-memory", "40GiB"], "is ambiguous"),
    (["replay", "--trace", "peer", "--model", "Llama-3.1-8B", "--gpu-memory", "abc"], "cannot read 'abc'"),
    (["generate", "--random", "tiny-llama"], "'tiny-llama' is not a tiny random model"),
    (["serve", "--random", "tiny-llama"], "'tiny-llama' is not a tiny random model"),
    (["serve", "--random", "tiny-qwen3-next", "--port", "http"], "--port"),
    (["serve-pd", "--random", "tiny-llama"], "'tiny-llama' is not a tiny random model"),
    (["bench", "engine", "--model", "tiny-llama"], "unknown models ['tiny-llama']"),
    (["bench", "serve", "--requests", "0"], "--requests"),
    (["bench", "memory", "--device", "tpu"], "'tpu' is not a device here"),
    (["bench", "memory", "--device", "cpu:x"], "'cpu:x' is not a device here"),
    (["pd-demo", "--requests", "0"], "--requests"),
    (["generate", "--random", "tiny-qwen3-next", "--max-step-tokens", "0"], "--max-step-tokens"),
    (["serve", "--random", "tiny-qwen3-next", "--max-running", "0"], "--max-running"),
    (["serve", "--random", "tiny-qwen3-next", "--stream-interval", "0"], "--stream-interval"),
    (["generate", "--random", "tiny-qwen3-next", "--temperature", "nan"], "temperature: must be a finite number"),
    (["serve-pd", "--random", "tiny-qwen3-next", "--top-p", "0"], "top_p: must be a finite number in (0.0, 1.0]"),
    (["pd-demo", "--transport", "nixl"], "unknown transport 'nixl'; known: shm, mooncake"),
    (["serve-pd", "--random", "tiny-qwen3-next", "--transport", "tcp"], "unknown transport 'tcp'"),
    (["no-such-command"], "No such command"),
]

PROBE = """
import contextlib, io, json, sys
from hybridkv.cli import main
rows = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(argv)
    rows.append({"status": status, "stderr": err.getvalue(), "torch": "torch" in sys.modules})
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def answers() -> list[dict[str, object]]:
    argvs = [argv for argv, _ in BAD_COMMAND_LINES]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True, text=True, timeout=120, check=True
    )
    rows: list[dict[str, object]] = json.loads(done.stdout)
    return rows


@pytest.mark.parametrize("index", range(len(BAD_COMMAND_LINES)), ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_a_usage_error_is_answered_without_loading_torch(answers: list[dict[str, object]], index: int) -> None:
    argv, expected = BAD_COMMAND_LINES[index]
    row = answers[index]
    stderr = str(row["stderr"])
    assert row["status"] == 2, stderr
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert expected in stderr
    assert row["torch"] is False, f"{' '.join(argv)} imported torch before answering"


def test_importing_the_cli_loads_no_library_package() -> None:
    heavy = ("torch", "transformers", "hybridkv.memory", "hybridkv.spec")
    code = f"import sys, hybridkv.cli; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(("module", "name"), LIBRARY_USER_ERRORS)
def test_every_library_user_error_the_cli_names_exists(module: str, name: str) -> None:
    assert issubclass(getattr(importlib.import_module(module), name), Exception)


def test_the_catalogue_lists_the_tiny_presets_spec_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridkv.spec import presets

    assert tuple(presets._tiny_specs()) == TINY_PRESETS
    assert len(set(preset_names())) == len(preset_names())
    monkeypatch.setattr(presets, "TINY_PRESETS", TINY_PRESETS[:-1])
    with pytest.raises(PresetError, match="list each tiny preset in both"):
        presets._tiny_specs()


def test_a_preset_name_resolves_exactly_or_by_a_unique_part() -> None:
    assert resolve_preset("tiny-gdn") == "tiny-gdn"  # exact, though tiny-gdn-bf16 contains it
    assert resolve_preset("qwen3-next") == "Qwen3-Next-80B-A3B-Instruct"
    with pytest.raises(PresetError, match="ambiguous"):
        resolve_preset("gpt-oss")
