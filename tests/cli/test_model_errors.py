"""A model directory, config or budget the user got wrong is a user error (issue 19 items 3-5):
one ``error:`` line, exit 2. Before, each of these ended as "error: internal error <Type> ...
(rerun with --debug)", exit 1 (the path for bugs), or was served silently (NaN weights: exit 0,
token 0 everywhere)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybridkv.cli import main
from tests.engine.harness import hf_model
from tests.engine.test_untrusted_weights import bounded_memory

NAME = "tiny-qwen3-next"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / NAME
    hf_model(NAME).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text('{"prompt_ids": [5, 6, 7]}\n')
    return path


def _config(**fields: object):
    def change(path: Path) -> None:
        data = json.loads((path / "config.json").read_text())
        data.update(fields)
        (path / "config.json").write_text(json.dumps(data))

    return change


def _weights(change):
    def damage(path: Path) -> None:
        change(path / "model.safetensors")

    return damage


def _nan(file: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    tensors["model.layers.1.self_attn.q_proj.weight"][0, 0] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:100_000])


MODEL_CASES = {
    "truncated": (_weights(_truncate), "truncated"),
    "not-safetensors": (_weights(lambda f: f.write_text("not a checkpoint\n")), "not a safetensors file"),
    "hidden-str": (_config(hidden_size="64"), "'hidden_size' must be an integer"),
    "eos-str": (_config(eos_token_id="x"), "'eos_token_id' must be a token id"),
    "vocab-negative": (_config(vocab_size=-1), "'vocab_size' must be positive"),
    "moe-negative": (_config(moe_intermediate_size=-3), "'moe_intermediate_size' must be positive"),
    "dtype": (_config(dtype="float99"), "'dtype' is 'float99'"),
    "layers-disagree": (_config(num_hidden_layers=3), "num_hidden_layers"),
    "nan": (_weights(_nan), "non-finite weights (NaN or inf) in model.layers.1.self_attn.q_proj.weight"),
    "huge": (_config(hidden_size=150_000), "wrong shapes"),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_a_bad_model_directory_is_one_error_line(case, checkpoint, prompts, tmp_path, capsys):
    change, says = MODEL_CASES[case]
    path = tmp_path / "model"
    shutil.copytree(checkpoint, path)
    change(path)
    with bounded_memory():
        code = main(["generate", "--model", str(path), "--prompts", str(prompts), "--gpu-memory", "8MiB"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert says in lines[0] and "internal error" not in lines[0], lines[0]
    assert not out


def test_a_deeply_nested_hf_config_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    assert main(["plan", "--hf-config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nested deeper than 32 levels" in err[0], err


def test_huge_block_tokens_are_refused_before_building_prompts(capsys):
    with bounded_memory():  # before the fix: ~10 GB of prompt ids (the OOM killer, or exit 1 under a limit)
        assert main(["bench", "engine", "--model", NAME, "--requests", "2", "--block-tokens", "1000000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--block-tokens 1000000000 makes prompts of up to" in err[0], err


@pytest.mark.parametrize("command", ["generate", "serve-pd"])
def test_a_budget_the_host_cannot_hold_is_refused_before_allocating(command, prompts, capsys):
    args = [command, "--random", NAME, "--prompts", str(prompts), "--gpu-memory", "900TiB"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu-memory 900TiB needs 900.00 TiB but cpu has" in err[0], err
