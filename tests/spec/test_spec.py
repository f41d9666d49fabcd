"""Model specs, parallel layouts and presets against the published facts."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridkv.spec import (
    FullAttention,
    KindTag,
    Linear,
    Parallel,
    PresetError,
    ShardSpec,
    SlidingWindow,
    StateTensor,
    get_preset,
    published_record,
    real_preset_names,
    tiny_preset_names,
)
from hybridkv.spec.presets import spec_from_record


def test_all_thirteen_real_presets_load_with_their_published_byte_counts():
    names = real_preset_names()
    assert len(names) == 13
    for name in names:
        spec = get_preset(name)
        derived = published_record(name)["derived"]
        full = spec.kv_bytes_per_token(KindTag.FULL) + spec.kv_bytes_per_token(KindTag.MLA)
        assert full == derived.get(
            "full_attention_kv_bytes_per_token_bf16", derived.get("mla_kv_bytes_per_token_bf16", full)
        ), name
        if "swa_kv_bytes_per_token_bf16" in derived:
            assert spec.kv_bytes_per_token(KindTag.SWA) == derived["swa_kv_bytes_per_token_bf16"], name
        if "recurrent_state_bytes_per_request_conv_bf16_ssm_fp32" in derived:
            assert spec.state_bytes_per_request() == derived["recurrent_state_bytes_per_request_conv_bf16_ssm_fp32"]


def test_published_layer_patterns():
    qwen = get_preset("Qwen3-Next-80B-A3B-Instruct")
    assert qwen.layer_ids(KindTag.FULL) == list(range(3, 48, 4))
    assert qwen.layer(0).tag is KindTag.LINEAR
    gemma = get_preset("Gemma-3-27B-IT")
    assert gemma.windows() == [1024] and len(gemma.layer_ids(KindTag.SWA)) == 52
    nemotron = get_preset("NVIDIA-Nemotron-Nano-9B-v2")
    assert len(nemotron.layer_ids(KindTag.NONE)) == 25
    kimi = get_preset("Kimi-Linear-48B-A3B-Instruct")
    assert kimi.tags() == {KindTag.LINEAR, KindTag.MLA}


def test_tiny_presets_cover_every_hybrid_shape():
    shapes = {frozenset(get_preset(n).tags()) for n in tiny_preset_names()}
    for wanted in (
        {KindTag.FULL},
        {KindTag.MLA},
        {KindTag.FULL, KindTag.SWA},
        {KindTag.FULL, KindTag.SWA, KindTag.LINEAR},
        {KindTag.FULL, KindTag.LINEAR},
        {KindTag.MLA, KindTag.LINEAR},
        {KindTag.FULL, KindTag.LINEAR, KindTag.NONE},
    ):
        assert frozenset(wanted) in shapes
    assert get_preset("tiny-swa2-state").windows() == [8, 24]


def test_pipeline_stages_are_end_exclusive_and_tile_the_layers():
    assert Parallel(pp_size=3).stage_bounds(10) == [(0, 4), (4, 7), (7, 10)]
    assert Parallel(pp_size=2, pp_starts=(0, 6)).stage_bounds(8) == [(0, 6), (6, 8)]
    with pytest.raises(ValueError, match="start at 0 and increase"):
        Parallel(pp_size=2, pp_starts=(0, 0))
    with pytest.raises(ValueError, match="last stage empty"):
        Parallel(pp_size=2, pp_starts=(0, 8)).stage_bounds(8)
    with pytest.raises(ValueError, match="exceeds"):
        Parallel(pp_size=9).stage_bounds(8)


def test_tp_head_ranges_split_or_replicate_gqa_heads():
    p4 = Parallel(tp_size=4)
    assert [p4.kv_head_range(8, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [p4.kv_head_range(2, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match="divides"):
        Parallel(tp_size=4).kv_head_range(6, 0)
    with pytest.raises(ValueError, match="multiple"):
        Parallel(tp_size=6).kv_head_range(4, 0)


def test_shard_spec_answers_for_its_own_stage_and_rank():
    qwen = get_preset("Qwen3-Next-80B-A3B-Instruct")
    shard = ShardSpec(qwen, Parallel(tp_size=4, pp_size=2), pp_rank=1, tp_rank=3)
    assert shard.bounds == (24, 48) and shard.layers[0].layer_id == 24
    assert not shard.has_layer(3)
    full = shard.local_kind(27)
    assert isinstance(full, FullAttention) and full.num_kv_heads == 1  # 2 heads over TP 4
    assert shard.kv_head_range(27) == (1, 2)
    gdn = shard.local_kind(24)
    assert isinstance(gdn, Linear)
    assert {s.name: s.shape for s in gdn.states} == {
        "conv_q": (512, 3),  # each component split on its own channels: the rank's q, k and v
        "conv_k": (512, 3),
        "conv_v": (1024, 3),
        "recurrent_state": (8, 128, 128),
    }
    with pytest.raises(KeyError, match="not on PP stage 1"):
        shard.local_kind(3)


def test_bad_configs_get_clear_errors():
    record = copy.deepcopy(published_record("gpt-oss-20b"))
    record["swa"]["head_dim"] = 96
    with pytest.raises(PresetError, match="derived as 2560 but the preset states 2048"):
        spec_from_record(record)
    record = copy.deepcopy(published_record("gpt-oss-20b"))
    record["layers"]["ids_by_kind"]["sliding_attention"].pop()
    with pytest.raises(PresetError, match="have no kind"):
        spec_from_record(record)
    record = copy.deepcopy(published_record("gpt-oss-20b"))
    record["layers"]["ids_by_kind"]["retention"] = []
    with pytest.raises(PresetError, match="unknown layer kind 'retention'"):
        spec_from_record(record)
    with pytest.raises(PresetError, match="no preset named"):
        get_preset("llama-9000")
    with pytest.raises(ValueError, match="window must be positive"):
        SlidingWindow(0, 1, 8, 8)
    with pytest.raises(ValueError, match="not divisible by TP size 3"):
        StateTensor("ssm", (4, 8), torch.float32, tp_dim=0).shard(3)


def test_each_state_tensor_takes_its_tp_split_from_its_own_record():
    """A conv window splits on its channels, a recurrent matrix on its heads, wherever those
    dims sit in the shape; a replicated tensor is not split at all."""
    for name in real_preset_names():
        linear = published_record(name).get("linear")
        if not linear:
            continue
        kinds = {layer.kind for layer in get_preset(name).layers if isinstance(layer.kind, Linear)}
        (kind,) = kinds
        for tensor, facts in zip(kind.states, linear["state_tensors_per_layer"], strict=True):
            assert facts["dims"][tensor.tp_dim] == facts["tp_split"], (name, tensor.name)
            expected = "conv_channels" if tensor.name.startswith("conv") else ("heads", "value_heads", "d_inner")
            assert facts["tp_split"] in expected, (name, tensor.name)

    record = copy.deepcopy(published_record("Qwen3-Next-80B-A3B-Instruct"))
    conv, *_, recurrent = record["linear"]["state_tensors_per_layer"]
    conv["shape"], conv["dims"] = conv["shape"][::-1], conv["dims"][::-1]  # stored (K - 1, channels)
    recurrent["tp_split"] = None  # every rank holds the whole matrix
    shard = ShardSpec(spec_from_record(record), Parallel(tp_size=4), 0, 1)
    gdn = shard.local_kind(0)
    assert isinstance(gdn, Linear)
    assert {s.name: (s.shape, s.tp_dim) for s in gdn.states} == {
        "conv_q": ((3, 512), 1),
        "conv_k": ((512, 3), 0),
        "conv_v": ((1024, 3), 0),
        "recurrent_state": ((32, 128, 128), None),
    }

    del recurrent["tp_split"]
    with pytest.raises(PresetError, match=r"needs 'dims' .* and 'tp_split'"):
        spec_from_record(record)
    recurrent["tp_split"] = "channels"
    with pytest.raises(PresetError, match="tp_split 'channels' is not one of its dims"):
        spec_from_record(record)
