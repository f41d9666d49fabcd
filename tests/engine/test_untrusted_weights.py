"""A model directory from someone else (issue 19 items 3-5): non-finite weights, a config whose
shapes disagree with the checkpoint, a checkpoint that is not (all) there, config fields of the
wrong type or range. Each is refused with a typed error naming the tensor / file / field, before
anything the size of the config is allocated. Before: NaN weights were served (token 0 everywhere),
a config with hidden_size 150000 next to a 1.3 MB checkpoint built GBs of parameters before the
shape check, and a truncated file or a mistyped field raised the library's internal errors."""

from __future__ import annotations

import json
import resource
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from hybridkv.engine.errors import WeightError
from hybridkv.engine.registry import model_class
from hybridkv.engine.weights import (
    NonFiniteWeightError,
    build_model,
    from_directory,
    load_weights,
    read_config,
    read_safetensors,
)
from hybridkv.spec.hf_config import HFConfigError
from tests.engine.harness import hf_model

NAME = "tiny-qwen3-next"
HEADROOM = 512 << 20  # what a refused load may allocate on top of what the process holds


@contextmanager
def bounded_memory(extra: int = HEADROOM) -> Iterator[None]:
    """Heap and private mappings limited to what the process holds now + ``extra`` (RLIMIT_DATA):
    an allocation the size of the hostile config fails inside the block."""
    status = Path("/proc/self/status").read_text()
    data_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmData:")))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data_kib * 1024 + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / NAME
    hf_model(NAME).save_pretrained(path)
    return path


def variant(checkpoint: Path, tmp_path: Path, **config: object) -> Path:
    """A copy of the checkpoint directory with ``config`` fields replaced."""
    path = tmp_path / "model"
    shutil.copytree(checkpoint, path)
    data = json.loads((path / "config.json").read_text())
    data.update(config)
    (path / "config.json").write_text(json.dumps(data))
    return path


# --- item 3: non-finite weights --------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(bad: float) -> None:
    hf = hf_model(NAME)
    tensors = {k: v.clone() for k, v in hf.state_dict().items()}
    tensors["model.layers.2.linear_attn.A_log"][1] = bad
    tensors["model.norm.weight"][0] = bad
    with pytest.raises(NonFiniteWeightError, match=r"non-finite.*model\.layers\.2\.linear_attn\.A_log.*model\.norm"):
        build_model(hf.config, tensors)
    model = model_class(hf.config.model_type)(hf.config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteWeightError):
        load_weights(model, tensors)
    after = model.state_dict()  # nothing was copied (bitwise: fresh parameters may hold NaN)
    assert all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in before)


def test_non_finite_weights_in_a_directory_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = variant(checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.embed_tokens.weight"][7, 3] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeightError, match=r"model\.embed_tokens\.weight"):
        from_directory(path)


# --- item 4: the config against the checkpoint, before allocating -----------------------


def test_a_huge_config_next_to_a_tiny_checkpoint_is_refused_with_bounded_memory(
    checkpoint: Path, tmp_path: Path
) -> None:
    path = variant(checkpoint, tmp_path, hidden_size=150_000)  # ~1.4 GB of parameters
    with bounded_memory(), pytest.raises(WeightError, match=r"wrong shapes: .*\(256, 64\).*wants \(256, 150000\)"):
        from_directory(path)


def test_a_shard_runner_refuses_a_huge_config_with_bounded_memory(checkpoint: Path, tmp_path: Path) -> None:
    from hybridkv.engine.config import EngineConfig
    from hybridkv.engine.runner import build_runner

    path = variant(checkpoint, tmp_path, hidden_size=150_000)
    with bounded_memory(), pytest.raises(WeightError, match=r"wrong shapes"):
        build_runner(path, path, EngineConfig(gpu_memory="4MiB", max_context=64))


def _write_safetensors(path: Path, header: dict[str, object], data_bytes: int) -> None:
    """A safetensors file of ``header`` whose data region is ``data_bytes`` long (sparse: not written)."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + data_bytes)


def test_checkpoint_shapes_are_checked_from_headers_before_any_data_is_read(checkpoint: Path, tmp_path: Path) -> None:
    path = variant(checkpoint, tmp_path)
    (path / "model.safetensors").unlink()
    rows, cols = 1 << 20, 1 << 10  # 4 GiB of float32 declared; the file is sparse
    entry = {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, rows * cols * 4]}
    header = {"model.embed_tokens.weight": entry}
    _write_safetensors(path / "model.safetensors", header, rows * cols * 4)
    with bounded_memory(), pytest.raises(WeightError, match=r"embed_tokens\.weight \(1048576, 1024\)"):
        from_directory(path)


# --- item 5: files that are not (all) there, fields of the wrong type -------------------


def _truncated(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _text(path: Path) -> None:
    (path / "model.safetensors").write_text("hello, this is not a checkpoint\n")


def _empty(path: Path) -> None:
    (path / "model.safetensors").write_bytes(b"")


def _bad_json(path: Path) -> None:
    _write_safetensors(path / "model.safetensors", {}, 0)
    raw = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(raw[:8] + b"x" + raw[9:])


def _overlapping(path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    _write_safetensors(path / "model.safetensors", header, 24)


def _unknown_dtype(path: Path) -> None:
    _write_safetensors(path / "model.safetensors", {"a": {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}}, 16)


BAD_FILES = {
    "truncated": (_truncated, "truncated"),
    "text": (_text, "not a safetensors file"),
    "empty": (_empty, "not a safetensors file"),
    "bad-json": (_bad_json, "not a safetensors file"),
    "overlapping": (_overlapping, "overlap"),
    "unknown-dtype": (_unknown_dtype, "dtype 'F99'"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_broken_safetensors_file_is_a_weight_error_naming_the_file(case: str, checkpoint: Path, tmp_path: Path):
    path = variant(checkpoint, tmp_path)
    damage, says = BAD_FILES[case]
    damage(path)
    for read in (read_safetensors, from_directory):
        with pytest.raises(WeightError, match=says) as info:
            read(path)
        assert "model.safetensors" in str(info.value)


BAD_FIELDS = {
    "hidden-str": ({"hidden_size": "64"}, "'hidden_size' must be an integer"),
    "eos-str": ({"eos_token_id": "x"}, "'eos_token_id' must be a token id"),
    "eos-outside": ({"eos_token_id": [1, 999]}, "'eos_token_id' must be a token id"),
    "vocab-negative": ({"vocab_size": -1}, "'vocab_size' must be positive"),
    "moe-negative": ({"moe_intermediate_size": -3}, "'moe_intermediate_size' must be positive"),
    "huge": ({"num_attention_heads": 1 << 40}, "'num_attention_heads' must be at most"),
    "dtype": ({"dtype": "float99"}, "'dtype' is 'float99'"),
    "eps": ({"rms_norm_eps": "x"}, "'rms_norm_eps' must be a finite number"),
    "nan": ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "'rope_theta' must be"),
    "bool": ({"tie_word_embeddings": "no"}, "'tie_word_embeddings' must be true or false"),
    "layers": ({"num_hidden_layers": 0}, "'num_hidden_layers' must be positive"),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_config_fields_are_checked_against_a_schema_before_use(case: str, checkpoint: Path, tmp_path: Path):
    fields, says = BAD_FIELDS[case]
    path = variant(checkpoint, tmp_path, **fields)
    with pytest.raises(HFConfigError, match=says):
        read_config(path)
    with pytest.raises(HFConfigError, match=says):
        from_directory(path)


def test_a_deeply_nested_config_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    path = variant(checkpoint, tmp_path)
    (path / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(HFConfigError, match="nested deeper than"):
        read_config(path)
