"""``from_hf_config``: the published configs of the 13 real presets give their specs; bad configs name the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.spec import (
    HFConfigError,
    KindTag,
    Linear,
    from_hf_config,
    get_preset,
    published_record,
    real_preset_names,
)

# --- the 13 real presets, from the config fields their records publish -----------------------------------------------


def _attention_fields(record: dict[str, Any]) -> dict[str, Any]:
    full = record["full_attention"] or record["swa"]
    return {
        "hidden_size": record["hidden_size"],
        "num_hidden_layers": record["num_layers"],
        "num_attention_heads": record["num_attention_heads"],
        "num_key_value_heads": full["num_kv_heads"],
        "head_dim": full["head_dim"],
        "max_position_embeddings": record["max_position_embeddings"],
        "torch_dtype": record["dtype"],
    }


def _gdn_fields(record: dict[str, Any]) -> dict[str, Any]:
    lin = record["linear"]
    return {
        **_attention_fields(record),
        # records: "full_attention_interval 4: layer i is full attention iff (i+1) % 4 == 0" (layers.note)
        "full_attention_interval": 4,
        "linear_num_key_heads": lin["linear_num_key_heads"],
        "linear_num_value_heads": lin["linear_num_value_heads"],
        "linear_key_head_dim": lin["linear_key_head_dim"],
        "linear_value_head_dim": lin["linear_value_head_dim"],
        "linear_conv_kernel_dim": lin["conv_kernel"],
    }


def _llama(record: dict[str, Any]) -> dict[str, Any]:
    fields = _attention_fields(record)
    del fields["head_dim"]  # Llama configs derive it: hidden_size / num_attention_heads
    return {"model_type": "llama", **fields}


def _deepseek_v3(record: dict[str, Any]) -> dict[str, Any]:
    mla = record["mla"]
    return {
        "model_type": "deepseek_v3",
        "num_hidden_layers": record["num_layers"],
        "num_attention_heads": mla["num_heads"],
        "q_lora_rank": mla["q_lora_rank"],
        "kv_lora_rank": mla["kv_lora_rank"],
        "qk_nope_head_dim": mla["qk_nope_head_dim"],
        "qk_rope_head_dim": mla["qk_rope_head_dim"],
        "v_head_dim": mla["v_head_dim"],
        "num_nextn_predict_layers": record["mtp"]["num_nextn_predict_layers"],
        "max_position_embeddings": record["max_position_embeddings"],
        "torch_dtype": record["dtype"],
    }


def _gpt_oss(record: dict[str, Any]) -> dict[str, Any]:
    fields = _attention_fields(record)
    del fields["torch_dtype"]  # dtype_note: "HF config.json has no torch_dtype key"
    # layers.note: "layer_types = ['sliding_attention','full_attention'] * N/2"
    layer_types = ["sliding_attention", "full_attention"] * (record["num_layers"] // 2)
    return {"model_type": "gpt_oss", **fields, "layer_types": layer_types, "sliding_window": record["swa"]["window"]}


def _gemma3(record: dict[str, Any]) -> dict[str, Any]:
    text = _attention_fields(record)
    dtype = text.pop("torch_dtype")
    # source: "sliding_window 1024, sliding_window_pattern 6" (no layer_types in the published text_config)
    text.update(model_type="gemma3_text", sliding_window=record["swa"]["window"], sliding_window_pattern=6)
    return {"model_type": "gemma3", "torch_dtype": dtype, "text_config": text}


def _qwen3_next(record: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "qwen3_next", **_gdn_fields(record)}


def _qwen3_5_moe(record: dict[str, Any]) -> dict[str, Any]:
    text = {"model_type": "qwen3_5_moe_text", **_gdn_fields(record), "mamba_ssm_dtype": "float32"}
    return {"model_type": "qwen3_5_moe", "text_config": text}


def _kimi_linear(record: dict[str, Any]) -> dict[str, Any]:
    mla, lin = record["mla"], record["linear"]
    # layers.note: "linear_attn_config.full_attn_layers [4,8,12,16,20,24,27] and kda_layers (the other 20) are
    # 1-INDEXED in config.json"
    full = [4, 8, 12, 16, 20, 24, 27]
    return {
        "model_type": "kimi_linear",
        "num_hidden_layers": record["num_layers"],
        "num_attention_heads": mla["num_heads"],
        "kv_lora_rank": mla["kv_lora_rank"],
        "qk_nope_head_dim": mla["qk_nope_head_dim"],
        "qk_rope_head_dim": mla["qk_rope_head_dim"],
        "v_head_dim": mla["v_head_dim"],
        "model_max_length": record["max_position_embeddings"],
        "torch_dtype": record["dtype"],
        "linear_attn_config": {
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, record["num_layers"] + 1) if i not in full],
            "num_heads": lin["num_heads"],
            "head_dim": lin["head_dim"],
            "short_conv_kernel_size": lin["conv_kernel"],
        },
    }


def _jamba(record: dict[str, Any]) -> dict[str, Any]:
    lin, fields = record["linear"], _attention_fields(record)
    del fields["head_dim"]  # full_attention.note: "no head_dim key"
    return {
        "model_type": "jamba",
        **fields,
        # layers.note: "attn_layer_period 8, attn_layer_offset 4"
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_expand": lin["d_inner"] // record["hidden_size"],
        "mamba_d_state": lin["d_state"],
        "mamba_d_conv": lin["conv_kernel"],
    }


def _nemotron_h(record: dict[str, Any]) -> dict[str, Any]:
    lin = record["linear"]
    return {
        "model_type": "nemotron_h",
        **_attention_fields(record),
        "hybrid_override_pattern": record["hybrid_override_pattern"],
        "mamba_num_heads": lin["mamba_num_heads"],
        "mamba_head_dim": lin["mamba_head_dim"],
        "n_groups": lin["n_groups"],
        "ssm_state_size": lin["ssm_state_size"],
        "conv_kernel": lin["conv_kernel"],
    }


def _minimax_m1(record: dict[str, Any]) -> dict[str, Any]:
    fields = _attention_fields(record)
    del fields["torch_dtype"]  # dtype_note: "config.json has no torch_dtype"
    # layers.note: "attn_type_list: 0 = lightning (linear) attention, 1 = softmax attention; 1 at indices 7,15,...,79"
    return {"model_type": "minimax_m1", **fields, "attn_type_list": [int(i % 8 == 7) for i in range(80)]}


_HF_CONFIG_OF = {
    "Llama-3.1-8B": _llama,
    "Llama-3.1-70B": _llama,
    "DeepSeek-V3": _deepseek_v3,
    "gpt-oss-120b": _gpt_oss,
    "gpt-oss-20b": _gpt_oss,
    "Gemma-3-27B-IT": _gemma3,
    "Qwen3-Next-80B-A3B-Instruct": _qwen3_next,
    "Kimi-Linear-48B-A3B-Instruct": _kimi_linear,
    "AI21-Jamba-1.5-Mini": _jamba,
    "NVIDIA-Nemotron-Nano-9B-v2": _nemotron_h,
    "MiniMax-M1-80k": _minimax_m1,
    "Qwen3.5-397B-A17B": _qwen3_5_moe,
    "Qwen3.5-35B-A3B": _qwen3_5_moe,
}


def test_every_real_preset_has_a_config_builder():
    assert sorted(_HF_CONFIG_OF) == sorted(real_preset_names())


@pytest.mark.parametrize("name", sorted(_HF_CONFIG_OF))
def test_published_config_gives_the_preset_spec(name: str):
    record = published_record(name)
    preset = get_preset(name)
    spec = from_hf_config(_HF_CONFIG_OF[name](record), name=name)
    assert spec.layers == preset.layers  # kinds, head dims, windows, state names/shapes/dtypes/TP dims
    assert spec.kv_dtype == preset.kv_dtype
    assert spec.kv_bytes_per_token(KindTag.FULL) == preset.kv_bytes_per_token(KindTag.FULL)
    assert spec.state_bytes_per_request() == preset.state_bytes_per_request()
    # max_context is the config's max_position_embeddings; only MiniMax-M1 advertises less (1M of 10.24M)
    assert spec.max_context == record["max_position_embeddings"]
    if name != "MiniMax-M1-80k":
        assert spec.max_context == preset.max_context


def test_preset_configs_survive_a_json_file_and_its_folder(tmp_path: Path):
    name = "NVIDIA-Nemotron-Nano-9B-v2"
    config = _nemotron_h(published_record(name))
    folder = tmp_path / "nemotron"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    by_file = from_hf_config(folder / "config.json")
    by_dir = from_hf_config(str(folder))
    assert by_file == by_dir
    assert by_file.name == "nemotron" and by_file.source == str(folder / "config.json")
    assert by_file.layers == get_preset(name).layers


def test_dtype_rules_defaults_and_overrides():
    config = _qwen3_next(published_record("Qwen3-Next-80B-A3B-Instruct"))
    del config["torch_dtype"]
    spec = from_hf_config(config)  # no dtype in the config: bfloat16 model, float32 recurrent state
    gdn = spec.layer(0).kind
    assert isinstance(gdn, Linear)
    assert spec.kv_dtype == torch.bfloat16
    assert [s.dtype for s in gdn.states] == [torch.bfloat16] * 3 + [torch.float32]  # conv q, k, v; recurrent

    over = from_hf_config({**config, "dtype": "float16"}, kv_dtype="float8_e4m3fn", state_dtype=torch.bfloat16)
    gdn = over.layer(0).kind
    assert isinstance(gdn, Linear)
    assert over.kv_dtype == torch.float8_e4m3fn
    assert [s.dtype for s in gdn.states] == [torch.float16] * 3 + [torch.bfloat16]  # conv keeps the model dtype

    nemotron = from_hf_config(
        {**_nemotron_h(published_record("NVIDIA-Nemotron-Nano-9B-v2")), "mamba_ssm_cache_dtype": "bfloat16"}
    )
    mamba = nemotron.layer(0).kind
    assert isinstance(mamba, Linear)
    assert (mamba.states[-1].name, mamba.states[-1].dtype) == ("ssm_state", torch.bfloat16)


def test_state_shapes_of_unequal_head_dims_follow_transformers_layout():
    config = {**_qwen3_next(published_record("Qwen3-Next-80B-A3B-Instruct")), "linear_value_head_dim": 64}
    gdn = from_hf_config(config).layer(0).kind
    assert isinstance(gdn, Linear)
    shapes = [(16 * 128, 3), (16 * 128, 3), (32 * 64, 3), (32, 128, 64)]  # conv q, k, v; (v_heads, k_dim, v_dim)
    assert [s.shape for s in gdn.states] == shapes
    assert [s.tp_dim for s in gdn.states] == [0, 0, 0, 0]


# --- refusals: each names the field and what to change -------------------------------------------------------------


def _qwen() -> dict[str, Any]:
    return _qwen3_next(published_record("Qwen3-Next-80B-A3B-Instruct"))


def _gpt() -> dict[str, Any]:
    return _gpt_oss(published_record("gpt-oss-20b"))


def _gemma_text() -> dict[str, Any]:
    return _gemma3(published_record("Gemma-3-27B-IT"))["text_config"]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({**_qwen(), "model_type": "bert"}, r"'model_type' is 'bert'.*supported: .*qwen3_next"),
        ({k: v for k, v in _qwen().items() if k != "model_type"}, r"'model_type' is None"),
        ({**_gpt(), "layer_types": _gpt()["layer_types"][:-1]}, r"'layer_types' gives 23 layers but .* is 24"),
        ({**_gpt(), "layer_types": []}, r"'layer_types' lists no layers"),
        ({k: v for k, v in _gpt().items() if k != "sliding_window"}, r"'sliding_window' is missing"),
        ({**_gpt(), "sliding_window": 0}, r"'sliding_window' must be positive, got 0"),
        (
            {**_gpt(), "layer_types": ["sliding_attention", "chunked_attention"] * 12},
            r"unknown types \['chunked_attention'\]",
        ),
        (
            {**_gpt(), "num_key_value_heads": 7},
            r"'num_key_value_heads' \(7\) does not divide 'num_attention_heads' \(64\)",
        ),
        ({**_qwen(), "linear_num_key_heads": 5}, r"'linear_num_key_heads' \(5\) does not divide"),
        ({**_qwen(), "linear_conv_kernel_dim": 1}, r"'linear_conv_kernel_dim' is 1.*kernel of 2 or more"),
        ({k: v for k, v in _qwen().items() if k != "full_attention_interval"}, r"'full_attention_interval' is missing"),
        ({**_qwen(), "head_dim": "256"}, r"'head_dim' must be an integer"),
        ({**_qwen(), "torch_dtype": "float128"}, r"'torch_dtype' is 'float128'.*unknown dtype"),
        ({**_qwen(), "max_position_embeddings": -1}, r"'max_position_embeddings' must be positive"),
        ({**_qwen(), "max_position_embeddings": None}, r"'max_position_embeddings' is missing"),
        ({"model_type": "gemma3", "torch_dtype": "bfloat16"}, r"'text_config' is missing"),
        (
            {"model_type": "gemma3", "text_config": {**_gemma_text(), "sliding_window_pattern": None}},
            r"text_config\).*'sliding_window_pattern' is missing",
        ),
        (
            {**_nemotron_h(published_record("NVIDIA-Nemotron-Nano-9B-v2")), "hybrid_override_pattern": "M-X*"},
            r"'hybrid_override_pattern' has unknown symbols \['X'\]",
        ),
        (
            {**_nemotron_h(published_record("NVIDIA-Nemotron-Nano-9B-v2")), "num_hidden_layers": 55},
            r"'hybrid_override_pattern' gives 56 layers but 'num_hidden_layers' is 55",
        ),
    ],
)
def test_bad_configs_name_the_field(config: dict[str, Any], match: str):
    with pytest.raises(HFConfigError, match=match):
        from_hf_config(config)


def test_kimi_layer_lists_must_cover_every_layer_once():
    config = _kimi_linear(published_record("Kimi-Linear-48B-A3B-Instruct"))
    lists = config["linear_attn_config"]
    overlap = copy.deepcopy(config)
    overlap["linear_attn_config"]["kda_layers"] = [*lists["kda_layers"], 4]
    with pytest.raises(HFConfigError, match=r"'kda_layers' repeats layer 4"):
        from_hf_config(overlap)
    gap = copy.deepcopy(config)
    gap["linear_attn_config"]["kda_layers"] = lists["kda_layers"][1:]
    with pytest.raises(HFConfigError, match=r"leave layers \[1\] without a kind"):
        from_hf_config(gap)
    zero_based = copy.deepcopy(config)
    zero_based["linear_attn_config"]["full_attn_layers"] = [0, *lists["full_attn_layers"][1:]]
    with pytest.raises(HFConfigError, match=r"'full_attn_layers' holds 0.*1-based"):
        from_hf_config(zero_based)


def test_bad_paths_and_inputs(tmp_path: Path):
    with pytest.raises(HFConfigError, match=r"cannot read config .*nowhere"):
        from_hf_config(tmp_path / "nowhere" / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFConfigError, match=r"is not valid JSON"):
        from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(HFConfigError, match=r"must hold a JSON object, not list"):
        from_hf_config(tmp_path)
    with pytest.raises(HFConfigError, match=r"expected a transformers config, a dict or a config.json path, got int"):
        from_hf_config(42)
    assert issubclass(HFConfigError, ValueError)
