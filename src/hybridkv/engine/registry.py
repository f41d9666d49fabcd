"""The one place that maps an architecture (HF ``model_type``) to its model class.

A new architecture is one model file (blocks + ``WEIGHT_MAP``) and one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from hybridkv.engine.models.base import CausalLM
from hybridkv.registry import Registry
from hybridkv.spec import ModelSpec, dtype_name, from_hf_config

_MODELS = Registry[str](
    "engine architecture (model_type)",
    {
        "gemma3_text": "hybridkv.engine.models.gemma3:Gemma3",
        "gpt_oss": "hybridkv.engine.models.gpt_oss:GptOss",
        "kimi_linear": "hybridkv.engine.models.kimi_linear:KimiLinear",
        "nemotron_h": "hybridkv.engine.models.nemotron_h:NemotronH",
        "qwen3_next": "hybridkv.engine.models.qwen3_next:Qwen3Next",
    },
)
"""``model_type`` -> ``module:Class``, imported when first used."""


def architectures() -> list[str]:
    return _MODELS.names()


def model_class(model_type: str) -> type[CausalLM]:
    """The model class of ``model_type``; ``UnknownName`` (a ``KeyError``) names the known ones."""
    module, name = _MODELS[model_type].split(":")
    cls: type[CausalLM] = getattr(importlib.import_module(module), name)
    return cls


def text_config(config: Any) -> Any:
    """The language model's config (Gemma 3's multimodal wrapper keeps it in ``text_config``)."""
    return config.text_config if getattr(config, "model_type", None) == "gemma3" else config


def engine_spec(config: Any, dtype: torch.dtype = torch.float32, name: str | None = None) -> ModelSpec:
    """The spec of a ``transformers`` config served in ``dtype``: K/V and conv windows (activations) in
    ``dtype``, recurrent matrices as the config says (fp32 by default); see ``hybridkv.spec.from_hf_config``."""
    return from_hf_config({**text_config(config).to_dict(), "dtype": dtype_name(dtype)}, name=name)


def eos_ids(config: Any) -> frozenset[int]:
    """The end-of-sequence ids a ``transformers`` config names (none: an empty set)."""
    eos = getattr(config, "eos_token_id", None)
    return frozenset([eos] if isinstance(eos, int) else (eos or []))
