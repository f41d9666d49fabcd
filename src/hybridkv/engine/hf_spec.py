"""A ``ModelSpec`` from a Hugging Face config, for the architectures the engine serves.

Private stand-in for ``hybridkv.spec.from_hf_config`` (written on another branch): the
lead swaps this module for it at merge. One table entry per ``model_type``.

Invariants:
- Layer ids follow the config's layer order; every layer gets exactly one kind.
- Recurrent state tensors are what the engine's layers really keep per request: the
  causal-conv window ``(conv_channels, kernel - 1)`` (the inputs the next token's
  convolution still needs) and the recurrent matrix (GatedDeltaNet / KDA:
  ``(heads, k_dim, v_dim)``; Mamba2: ``(heads, head_dim, ssm_state)``), fp32 for the
  recurrent matrix, the model dtype for the conv window.
- Every state tensor is split across TP ranks on dim 0 (channels or heads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridkv.spec import MLA, FullAttention, LayerKind, Linear, ModelSpec, NoCache, SlidingWindow, StateTensor


class HFSpecError(ValueError):
    """A config the engine cannot describe as a spec (unknown type, missing field)."""


def _get(config: Any, name: str) -> Any:
    value = getattr(config, name, None)
    if value is None:
        raise HFSpecError(f"{type(config).__name__} ({config.model_type}) lacks field {name!r}")
    return value


def _attention(config: Any, layer_type: str) -> LayerKind:
    kv_heads, head_dim = _get(config, "num_key_value_heads"), _get(config, "head_dim")
    if layer_type == "sliding_attention":
        return SlidingWindow(_get(config, "sliding_window"), kv_heads, head_dim, head_dim)
    if layer_type in ("full_attention", "attention"):
        return FullAttention(kv_heads, head_dim, head_dim)
    raise HFSpecError(f"{config.model_type}: unknown attention layer type {layer_type!r}")


def _conv_window(channels: int, kernel: int, dtype: torch.dtype) -> StateTensor:
    return StateTensor("conv_state", (channels, kernel - 1), dtype, tp_dim=0)  # TP splits the channels


def _qwen3_next(config: Any, dtype: torch.dtype) -> list[LayerKind]:
    k_heads, v_heads = _get(config, "linear_num_key_heads"), _get(config, "linear_num_value_heads")
    k_dim, v_dim = _get(config, "linear_key_head_dim"), _get(config, "linear_value_head_dim")
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    gdn = Linear(
        "gated_deltanet",
        (
            _conv_window(conv_dim, _get(config, "linear_conv_kernel_dim"), dtype),
            StateTensor("recurrent_state", (v_heads, k_dim, v_dim), torch.float32, tp_dim=0),
        ),
    )
    return [gdn if t == "linear_attention" else _attention(config, t) for t in _get(config, "layer_types")]


def _sliding_or_full(config: Any, dtype: torch.dtype) -> list[LayerKind]:
    return [_attention(config, t) for t in _get(config, "layer_types")]


def _nemotron_h(config: Any, dtype: torch.dtype) -> list[LayerKind]:
    heads, head_dim, n_state = (
        _get(config, "mamba_num_heads"),
        _get(config, "mamba_head_dim"),
        _get(config, "ssm_state_size"),
    )
    conv_dim = heads * head_dim + 2 * _get(config, "n_groups") * n_state
    mamba = Linear(
        "mamba2",
        (
            _conv_window(conv_dim, _get(config, "conv_kernel"), dtype),
            StateTensor("ssm_state", (heads, head_dim, n_state), torch.float32, tp_dim=0),
        ),
    )
    kinds: list[LayerKind] = []
    for t in _get(config, "layer_types"):
        if t in ("mamba", "linear_attention"):
            kinds.append(mamba)
        elif t in ("mlp", "moe"):
            kinds.append(NoCache())
        else:
            kinds.append(_attention(config, t))
    return kinds


def _kimi_linear(config: Any, dtype: torch.dtype) -> list[LayerKind]:
    heads, head_dim = _get(config, "linear_num_heads"), _get(config, "linear_head_dim")
    kda = Linear(
        "kda",
        (
            _conv_window(3 * heads * head_dim, _get(config, "linear_conv_kernel_dim"), dtype),
            StateTensor("recurrent_state", (heads, head_dim, head_dim), torch.float32, tp_dim=0),
        ),
    )
    mla = MLA(
        _get(config, "kv_lora_rank"),
        _get(config, "qk_rope_head_dim"),
        _get(config, "num_attention_heads"),
        _get(config, "v_head_dim"),
    )
    return [kda if t == "linear_attention" else mla for t in _get(config, "layer_types")]


_ARCHITECTURES: dict[str, Callable[[Any, torch.dtype], list[LayerKind]]] = {
    "qwen3_next": _qwen3_next,
    "gemma3_text": _sliding_or_full,
    "gpt_oss": _sliding_or_full,
    "nemotron_h": _nemotron_h,
    "kimi_linear": _kimi_linear,
}


def spec_from_hf_config(config: Any, dtype: torch.dtype = torch.float32, name: str | None = None) -> ModelSpec:
    """The spec of a ``transformers`` config object, with K/V (and conv windows) in ``dtype``."""
    model_type = str(getattr(config, "model_type", None))
    if model_type == "gemma3":
        config, model_type = config.text_config, config.text_config.model_type
    try:
        kinds_of = _ARCHITECTURES[model_type]
    except KeyError:
        raise HFSpecError(
            f"model_type {model_type!r} is not served by the engine; known: {sorted(_ARCHITECTURES)}"
        ) from None
    kinds = kinds_of(config, dtype)
    if len(kinds) != config.num_hidden_layers:
        raise HFSpecError(f"{model_type}: {len(kinds)} layer types but num_hidden_layers={config.num_hidden_layers}")
    return ModelSpec.from_kinds(
        name or model_type,
        kinds,
        kv_dtype=dtype,
        max_context=int(_get(config, "max_position_embeddings")),
        source=f"hf:{model_type}",
    )
