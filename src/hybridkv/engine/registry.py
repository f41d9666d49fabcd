"""The one place that maps an architecture (HF ``model_type``) to its model class.

A new architecture is one model file (blocks + ``WEIGHT_MAP``) and one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridkv.engine.models.base import CausalLM
from hybridkv.registry import Registry

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
