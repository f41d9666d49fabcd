"""Engine-neutral description of a model's layers, dtypes and parallel layout."""

from hybridkv.spec.hf_config import HFConfigError, from_hf_config
from hybridkv.spec.layers import (
    MLA,
    FullAttention,
    KindTag,
    LayerKind,
    Linear,
    NoCache,
    SlidingWindow,
    StateTensor,
    dtype_name,
    parse_dtype,
)
from hybridkv.spec.model import Layer, ModelSpec
from hybridkv.spec.parallel import Parallel, ShardSpec
from hybridkv.spec.presets import (
    PresetError,
    get_preset,
    preset_names,
    published_record,
    real_preset_names,
    tiny_preset_names,
)

__all__ = [
    "MLA",
    "FullAttention",
    "HFConfigError",
    "KindTag",
    "Layer",
    "LayerKind",
    "Linear",
    "ModelSpec",
    "NoCache",
    "Parallel",
    "PresetError",
    "ShardSpec",
    "SlidingWindow",
    "StateTensor",
    "dtype_name",
    "from_hf_config",
    "get_preset",
    "parse_dtype",
    "preset_names",
    "published_record",
    "real_preset_names",
    "tiny_preset_names",
]
