"""``from_hf_config`` on tiny random ``transformers`` models: the spec against what their caches really hold.

transformers 5.23.0 is the independent oracle: per layer, the K/V (or MLA latent) and conv/recurrent state
tensors its cache allocates after a short prompt must have the spec's shapes and dtypes, and the bytes per token
and per request must add up to the spec's.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.spec import MLA, FullAttention, KindTag, Linear, NoCache, SlidingWindow, from_hf_config

transformers = pytest.importorskip("transformers")  # the engine extra

_COMMON = {
    "vocab_size": 96,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
_TINY: dict[str, dict[str, Any]] = {
    "qwen3_next": {
        **_MOE,
        "num_hidden_layers": 4,
        "num_experts": 4,
        "shared_expert_intermediate_size": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 12,
        "linear_conv_kernel_dim": 4,
    },
    "gemma3_text": {
        "num_hidden_layers": 4,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "gpt_oss": {"num_hidden_layers": 4, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    "nemotron_h": {
        **_MOE,
        "hybrid_override_pattern": "M-*EM",
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "ssm_state_size": 8,
        "n_groups": 2,
        "conv_kernel": 4,
        "n_routed_experts": 4,
        "moe_shared_expert_intermediate_size": 32,
        "chunk_size": 8,
    },
    "kimi_linear": {
        **_MOE,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,  # MLA: one K/V head per query head in transformers' attention
        "num_local_experts": 4,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 12,
        "linear_attn_config": {
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
            "num_heads": 4,
            "head_dim": 8,
            "short_conv_kernel_size": 4,
        },
    },
}
_TINY_MORE: dict[str, dict[str, Any]] = {  # preset families beyond the five of issue 8
    "llama": {"num_hidden_layers": 2},
    "deepseek_v3": {
        **_MOE,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "head_dim": 8,  # transformers' DeepSeek-V3 rotates head_dim channels: the rope part
        "qk_nope_head_dim": 8,
        "v_head_dim": 12,
    },
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "num_experts": 2,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
    },
    "minimax": {"num_hidden_layers": 4, "num_local_experts": 2, "num_experts_per_tok": 1, "block_size": 8},
    "qwen3_5_text": {
        **{k: v for k, v in _TINY["qwen3_next"].items() if k.startswith("linear_")},
        "num_hidden_layers": 4,
    },
}
_TINY |= _TINY_MORE
_TAGS = {
    "qwen3_next": {KindTag.LINEAR, KindTag.FULL},
    "gemma3_text": {KindTag.SWA, KindTag.FULL},
    "gpt_oss": {KindTag.SWA, KindTag.FULL},
    "nemotron_h": {KindTag.LINEAR, KindTag.NONE, KindTag.FULL},
    "kimi_linear": {KindTag.LINEAR, KindTag.MLA},
    "llama": {KindTag.FULL},
    "deepseek_v3": {KindTag.MLA},
    "jamba": {KindTag.LINEAR, KindTag.FULL},
    "minimax": {KindTag.LINEAR, KindTag.FULL},
    "qwen3_5_text": {KindTag.LINEAR, KindTag.FULL},
}
_PROMPT_LEN = 13  # above every tiny window (8) so sliding layers are cut


@functools.cache
def _tiny(model_type: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """A tiny random model of ``model_type`` and its cache after a 13-token prompt (batch 2)."""
    config = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **_TINY[model_type]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.randint(3, _COMMON["vocab_size"], (2, _PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return model, cache


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _held(cache: Any, layer_id: int) -> dict[str, torch.Tensor]:
    """The non-empty tensors transformers' cache holds for one layer (``MiniMaxCache`` keeps lightning state apart)."""
    held: dict[str, torch.Tensor] = {}
    if layer_id < len(cache.layers):
        layer = cache.layers[layer_id]
        held |= {a: t for a in ("keys", "values") if isinstance(t := getattr(layer, a, None), torch.Tensor)}
        for name in ("conv_states", "recurrent_states"):
            if (state := (getattr(layer, name, None) or {}).get(0)) is not None:
                held[name] = state
    linear = getattr(cache, "linear_cache", [])
    if layer_id < len(linear) and isinstance(linear[layer_id], torch.Tensor):
        held["recurrent_states"] = linear[layer_id]
    return {name: t for name, t in held.items() if t.numel()}


@pytest.mark.parametrize("model_type", sorted(_TINY))
def test_spec_matches_the_cache_transformers_builds(model_type: str):
    model, cache = _tiny(model_type)
    spec = from_hf_config(model.config)
    assert spec.kv_dtype == torch.float32 and spec.max_context == 256
    assert spec.num_layers == len(cache) == model.config.num_hidden_layers
    batch = 2
    kv_bytes = {tag: 0 for tag in KindTag}
    state_bytes = 0
    for layer in spec.layers:
        kind, held = layer.kind, _held(cache, layer.layer_id)
        if isinstance(kind, FullAttention | SlidingWindow):
            tokens = _PROMPT_LEN if isinstance(kind, FullAttention) else kind.window - 1  # the query adds one
            assert held["keys"].shape == (batch, kind.num_kv_heads, tokens, kind.head_dim)
            assert held["values"].shape == (batch, kind.num_kv_heads, tokens, kind.v_head_dim)
            kv_bytes[layer.tag] += (_nbytes(held["keys"]) + _nbytes(held["values"])) // (batch * tokens)
        elif isinstance(kind, MLA):  # transformers caches the absorbed latent: c_kv as "keys", k_pe as "values"
            assert held["keys"].shape == (batch, 1, _PROMPT_LEN, kind.kv_lora_rank)
            assert held["values"].shape == (batch, 1, _PROMPT_LEN, kind.qk_rope_head_dim)
            kv_bytes[layer.tag] += (_nbytes(held["keys"]) + _nbytes(held["values"])) // (batch * _PROMPT_LEN)
        elif isinstance(kind, Linear):
            *conv_spec, recurrent_spec = kind.states
            assert sorted(held) == ["conv_states", "recurrent_states"][0 if conv_spec else 1 :]
            recurrent = held["recurrent_states"]
            assert (recurrent.shape, recurrent.dtype) == ((batch, *recurrent_spec.shape), recurrent_spec.dtype)
            state_bytes += _nbytes(recurrent) // batch
            if conv_spec:  # transformers keeps the whole kernel; the spec keeps the kernel - 1 inputs still read
                conv = held["conv_states"]  # one window over the concatenated components; the spec's are per part
                window = {c.shape[-1] for c in conv_spec}
                assert len(window) == 1 and {c.dtype for c in conv_spec} == {conv.dtype}
                assert conv.shape == (batch, sum(c.shape[0] for c in conv_spec), window.pop() + 1)
                state_bytes += (_nbytes(conv) - _nbytes(conv[..., 0])) // batch
        else:
            assert isinstance(kind, NoCache) and not held
    for tag in (KindTag.FULL, KindTag.SWA, KindTag.MLA):
        assert spec.kv_bytes_per_token(tag) == kv_bytes[tag]
    assert spec.state_bytes_per_request() == state_bytes
    assert {layer.tag for layer in spec.layers} == _TAGS[model_type]


@pytest.mark.parametrize("model_type", ["jamba", "kimi_linear", "minimax", "nemotron_h", "qwen3_5_text", "qwen3_next"])
def test_a_bf16_model_keeps_conv_windows_in_bf16_and_recurrent_state_in_fp32(model_type: str):
    model, cache = _tiny(model_type, torch.bfloat16)
    spec = from_hf_config(model.config)
    assert spec.kv_dtype == torch.bfloat16
    for layer in spec.layers:
        if not isinstance(layer.kind, Linear):
            continue
        held = _held(cache, layer.layer_id)
        *conv, recurrent = layer.kind.states
        assert [c.dtype for c in conv] == [held["conv_states"].dtype for _ in conv] == [torch.bfloat16 for _ in conv]
        if model_type == "minimax":  # MiniMax-M1's reference code keeps float32; transformers' port the model dtype
            assert (held["recurrent_states"].dtype, recurrent.dtype) == (torch.bfloat16, torch.float32)
        else:
            assert held["recurrent_states"].dtype == recurrent.dtype == torch.float32


@pytest.mark.parametrize("model_type", ["jamba", "kimi_linear", "nemotron_h", "qwen3_5_text", "qwen3_next"])
def test_the_conv_column_the_spec_drops_is_never_read_again(model_type: str):
    model, cache = _tiny(model_type)
    spec = from_hf_config(model.config)
    linear = [layer.layer_id for layer in spec.layers if isinstance(layer.kind, Linear) and len(layer.kind.states) > 1]
    assert linear

    def next_logits(column: int | None) -> torch.Tensor:
        held = copy.deepcopy(cache)
        if column is not None:
            for i in linear:
                held.layers[i].conv_states[0][..., column] = 1e4
        with torch.no_grad():
            return model(torch.tensor([[5], [7]]), past_key_values=held, use_cache=True).logits

    reference = next_logits(None)
    assert torch.equal(next_logits(0), reference)  # the oldest of the kernel columns transformers keeps
    assert not torch.equal(next_logits(1), reference)  # the first column the spec keeps


@pytest.mark.parametrize("model_type", sorted(_TINY))
def test_saved_tiny_config_reads_back_to_the_same_spec(tmp_path: Path, model_type: str):
    model, _ = _tiny(model_type)
    model.config.save_pretrained(tmp_path)
    assert from_hf_config(tmp_path / "config.json", name="x").layers == from_hf_config(model.config).layers
    assert from_hf_config(model.config.to_dict()) == from_hf_config(model.config)


def test_multimodal_config_objects_read_their_text_config():
    gemma = transformers.Gemma3Config(
        text_config={**_COMMON, **_TINY["gemma3_text"]}, vision_config={"hidden_size": 32, "num_hidden_layers": 1}
    )
    gemma.dtype = "bfloat16"  # on the wrapper only: the text model inherits it
    spec = from_hf_config(gemma, name="tiny-gemma3")
    assert [layer.tag for layer in spec.layers] == [KindTag.SWA, KindTag.FULL] * 2
    assert spec.kv_dtype == torch.bfloat16 and spec.windows() == [8]

    qwen = transformers.AutoConfig.for_model(
        "qwen3_5_moe", text_config={**_COMMON, **_TINY["qwen3_5_text"], "dtype": "float32"}
    )
    spec = from_hf_config(qwen)
    assert spec.name == "qwen3_5_moe_text" and spec.kv_dtype == torch.float32
    assert [layer.tag for layer in spec.layers] == [KindTag.LINEAR] * 3 + [KindTag.FULL]
