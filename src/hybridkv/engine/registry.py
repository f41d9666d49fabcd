"""The one place that maps an architecture (HF ``model_type``) to its model class.

A new architecture is one model file (blocks + ``WEIGHT_MAP``) and one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridkv.engine.models.base import CausalLM

_MODELS: dict[str, str] = {
    "gemma3_text": "hybridkv.engine.models.gemma3:Gemma3",
    "gpt_oss": "hybridkv.engine.models.gpt_oss:GptOss",
    "kimi_linear": "hybridkv.engine.models.kimi_linear:KimiLinear",
    "nemotron_h": "hybridkv.engine.models.nemotron_h:NemotronH",
    "qwen3_next": "hybridkv.engine.models.qwen3_next:Qwen3Next",
}


def architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(model_type: str) -> type[CausalLM]:
    try:
        module, name = _MODELS[model_type].split(":")
    except KeyError:
        raise KeyError(f"the engine has no model for model_type {model_type!r}; known: {architectures()}") from None
    cls: type[CausalLM] = getattr(importlib.import_module(module), name)
    return cls


def text_config(config: Any) -> Any:
    """The language model's config (Gemma 3's multimodal wrapper keeps it in ``text_config``)."""
    return config.text_config if getattr(config, "model_type", None) == "gemma3" else config
