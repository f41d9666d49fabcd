"""``hybridkv plan --hf-config``: a config.json plans exactly like its preset; bad input is one error line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app, main

# Qwen3-Next-80B-A3B-Instruct's published config.json, the fields hybridkv reads (see its preset's sources).
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}
PLAN = ["--gpu-memory", "80GiB", "--tp", "2", "--pp", "2", "--json"]


def _write(folder: Path, config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_hf_config_plans_like_the_preset(tmp_path: Path):
    path = _write(tmp_path / "Qwen3-Next-80B-A3B-Instruct", QWEN3_NEXT)
    from_config = CliRunner().invoke(app, ["plan", "--hf-config", str(path), *PLAN])
    from_preset = CliRunner().invoke(app, ["plan", "--model", "Qwen3-Next-80B-A3B-Instruct", *PLAN])
    assert from_config.exit_code == 0, from_config.output
    assert from_preset.exit_code == 0, from_preset.output
    assert json.loads(from_config.output) == json.loads(from_preset.output)  # the name comes from the folder


def test_hf_config_table_output_names_the_model(tmp_path: Path):
    path = _write(tmp_path / "my-qwen", QWEN3_NEXT)
    result = CliRunner().invoke(app, ["plan", "--hf-config", str(path.parent), "--gpu-memory", "40GiB"])
    assert result.exit_code == 0, result.output
    assert "my-qwen" in result.output and "concurrent requests" in result.output


@pytest.mark.parametrize(
    ("args", "config", "message"),
    [
        (["--model", "Qwen3-Next-80B-A3B-Instruct"], QWEN3_NEXT, "give exactly one of --model"),
        ([], None, "give exactly one of --model"),
        ([], "{oops", "is not valid JSON"),
        ([], {**QWEN3_NEXT, "model_type": "bert"}, "'model_type' is 'bert'"),
        ([], {**QWEN3_NEXT, "linear_num_key_heads": 5}, "'linear_num_key_heads' (5) does not divide"),
        (["--tp", "3"], QWEN3_NEXT, "not divisible"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], config: object, message: str
):
    hf = ["--hf-config", str(_write(tmp_path / "m", config))] if config is not None else []
    assert main(["plan", *hf, *args, "--gpu-memory", "80GiB"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert not out and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_missing_config_file_is_an_error_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["plan", "--hf-config", str(tmp_path / "absent" / "config.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read config") and "Traceback" not in err
