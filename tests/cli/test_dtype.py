"""``--dtype``: the same weights served in bf16 / fp16 by ``generate`` and ``serve-pd`` (and ``serve``, which
builds its engines the same way): tokens equal the library's engine in that dtype, K/V bytes shrink."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hybridkv.cli import main
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import build_random
from tests.engine.harness import prompt

PROMPTS = [prompt(700 + i, 9 + 13 * i) for i in range(3)]
NEW = 5


def _files(tmp_path: Path) -> list[str]:
    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    return ["--prompts", str(file), "--max-new-tokens", str(NEW), "--json"]


def _needs(err: str) -> float:
    """Bytes one request of the max context needs, from the sizing line."""
    found = re.search(r"needs ([\d.]+) (B|KiB|MiB)\)", err)
    assert found is not None, err
    return float(found.group(1)) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}[found.group(2)]


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3-next"])
def test_generate_in_bf16_equals_the_engine_in_bf16(name: str, tmp_path: Path, capsys) -> None:
    args = ["generate", "--random", name, *_files(tmp_path)]
    assert main([*args, "--dtype", "bfloat16"]) == 0
    out, err = capsys.readouterr()
    served = [r["output_ids"] for r in json.loads(out)["requests"]]
    weights, config = build_random(name)
    engine = Engine(config, weights, EngineConfig(gpu_memory="16MiB", dtype=torch.bfloat16))
    assert served == [o.output_ids for o in engine.generate(PROMPTS, NEW)]
    assert main([*args, "--dtype", "float32"]) == 0
    assert _needs(err) < _needs(capsys.readouterr().err)  # K/V (and conv windows) in half the bytes


def test_serve_pd_in_bf16_moves_fewer_bytes_and_equals_generate(tmp_path: Path, capsys) -> None:
    common = ["--random", "tiny-qwen3-next", *_files(tmp_path)]
    assert main(["generate", *common, "--dtype", "bfloat16"]) == 0
    generated = [r["output_ids"] for r in json.loads(capsys.readouterr().out)["requests"]]
    moved = {}
    for dtype in ("bfloat16", "float32"):
        assert main(["serve-pd", *common, "--decode-tp", "1", "--prefill-pp", "2", "--dtype", dtype]) == 0
        served = json.loads(capsys.readouterr().out)["requests"]
        moved[dtype] = sum(r["transfer_bytes"] for r in served)
        if dtype == "bfloat16":
            assert [r["output_ids"] for r in served] == generated
    # the recurrent state stays fp32 as the config says: less than fp32's bytes, more than half
    assert moved["float32"] / 2 < moved["bfloat16"] < moved["float32"], moved
