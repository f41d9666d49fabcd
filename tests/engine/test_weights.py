"""Weight loading: HF state_dict and save_pretrained directories, and every kind of mismatch named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridkv.engine.errors import WeightError
from hybridkv.engine.registry import architectures, model_class
from hybridkv.engine.weights import from_directory, from_hf_model, load_weights, read_safetensors
from tests.engine.harness import hf_model

MODELS = ["tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-next"]


@pytest.mark.parametrize("name", MODELS)
def test_directory_and_state_dict_give_the_same_weights(name: str, tmp_path: Path) -> None:
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    a, b = from_hf_model(hf), from_directory(tmp_path)
    assert type(a) is type(b) is model_class(hf.config.model_type)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def _fresh(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    hf = hf_model(name)
    model = model_class(hf.config.model_type)(hf.config)
    return model, dict(hf.state_dict())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_missing_weight_is_named() -> None:
    model, tensors = _fresh("tiny-qwen3-next")
    del tensors["model.layers.0.linear_attn.A_log"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightError, match=r"missing weights for layers\.0\.linear_attn\.A_log"):
        load_weights(model, tensors)
    # nothing was copied (bitwise: a fresh model's uninitialised parameters may hold NaN)
    assert all(_same_bits(before[k], v) for k, v in model.state_dict().items())


def test_unexpected_weight_is_named() -> None:
    model, tensors = _fresh("tiny-gpt-oss")
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    with pytest.raises(WeightError, match=r"unexpected weights model\.layers\.0\.self_attn\.extra\.weight"):
        load_weights(model, tensors)


def test_wrong_shape_is_named_with_both_shapes() -> None:
    model, tensors = _fresh("tiny-gemma3")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(WeightError, match=r"up_proj\.weight \(3, 64\) \(model layers\.1\.mlp\.up_proj\.weight wants"):
        load_weights(model, tensors)


def test_checkpoint_per_expert_weights_are_fused_and_a_missing_expert_is_named(tmp_path: Path) -> None:
    hf = hf_model("tiny-qwen3-next")
    hf.save_pretrained(tmp_path)
    tensors = read_safetensors(tmp_path)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in tensors  # the published layout, not state_dict's
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    model = model_class("qwen3_next")(hf.config)
    with pytest.raises(WeightError, match=r"missing expert weights model\.layers\.0\.mlp\.experts\.3\.up_proj"):
        load_weights(model, tensors)


def test_directory_without_weights_or_config(tmp_path: Path) -> None:
    with pytest.raises(WeightError, match=r"no \*\.safetensors"):
        read_safetensors(tmp_path)
    with pytest.raises(WeightError, match=r"no config\.json"):
        from_directory(tmp_path)


def test_registry_names_every_architecture() -> None:
    assert {"gemma3_text", "gpt_oss", "qwen3_next"} <= set(architectures())
    with pytest.raises(KeyError, match=r"unknown engine architecture \(model_type\) 'llama'; known: gemma3_text"):
        model_class("llama")
