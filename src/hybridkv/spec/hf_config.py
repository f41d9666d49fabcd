"""A ``ModelSpec`` from a Hugging Face config: a ``transformers`` config object, a dict, or a ``config.json`` path.

Invariants and conventions (checked against transformers 5.23.0's modeling code and caches):
- One table entry per ``model_type`` (``_ARCHITECTURES``): how to read the per-layer types, and one kind
  builder per type. A new architecture is one entry, never a branch elsewhere.
- Every field is read through ``_Fields``: a missing, non-positive or contradictory field raises
  ``HFConfigError`` naming the field and what to change; before that, the whole config is checked
  against the schema of field types and ranges (``hf_schema.check_fields``). Nothing is guessed
  except the defaults written here: the model dtype is ``bfloat16`` when the config has neither
  ``dtype`` nor ``torch_dtype`` (gpt-oss and MiniMax-M1 ship without one; their weights are bf16), and ``head_dim`` is
  ``hidden_size // num_attention_heads`` only for families whose transformers config does the same
  (Llama, Jamba, MiniMax).
- Dtypes: KV is the model dtype unless ``kv_dtype`` is given. Conv windows are activations, so they
  keep the model dtype. Recurrent matrices (GatedDeltaNet/KDA/lightning state, Mamba SSM state) are
  ``float32`` unless the config names ``mamba_ssm_dtype`` / ``mamba_ssm_cache_dtype`` or ``state_dtype``
  is given. transformers keeps exactly these dtypes for a bf16 model (bf16 conv, fp32 state), except its
  MiniMax port, which keeps lightning state in the model dtype where MiniMax-M1's reference code uses fp32.
- Conv windows are ``(channels, kernel - 1)``: the inputs a layer needs from before the next token.
  transformers' cache keeps ``kernel`` columns, but the oldest one is never read again.
- Recurrent matrices follow transformers' layout: GatedDeltaNet/KDA ``(v_heads, k_head_dim,
  v_head_dim)``, Mamba2 ``(heads, head_dim, d_state)``, Mamba1 ``(d_inner, d_state)``, lightning
  ``(heads, head_dim, head_dim)``.
- A conv window over concatenated components is one state tensor per component (GatedDeltaNet and
  KDA: ``conv_q``, ``conv_k``, ``conv_v``; Mamba2: ``conv_x``, ``conv_B``, ``conv_C``), so every state
  tensor is split by tensor parallelism as one contiguous range of dim 0: a rank's conv channels are
  its own part of each component, never one slice of the concatenation. Recurrent matrices split on
  heads, Mamba1's single ``conv_state`` and SSM state on ``d_inner``. The bytes per request equal
  those of one concatenated window.
- ``SlidingWindow.window`` is the config's ``sliding_window``: a query sees that many keys, itself
  included. MLA layers cache the absorbed latent (``kv_lora_rank + qk_rope_head_dim`` a token).
- ``max_context`` is ``max_position_embeddings`` (Kimi: ``model_max_length``). MTP layers are not
  counted: they exist only when speculative decoding is on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.registry import Registry
from hybridkv.spec.hf_schema import HFConfigError, check_fields, read_config_json
from hybridkv.spec.layers import (
    MLA,
    FullAttention,
    LayerKind,
    Linear,
    NoCache,
    SlidingWindow,
    StateTensor,
    parse_dtype,
)
from hybridkv.spec.model import ModelSpec


@dataclass(frozen=True)
class _Dtypes:
    model: torch.dtype  # activations: conv windows
    kv: torch.dtype  # K/V and MLA latents
    state: torch.dtype  # recurrent matrices


class _Fields:
    """Typed reads from one config mapping; every failure names the field."""

    def __init__(self, data: Mapping[str, Any], where: str, head_dim_from_hidden: bool) -> None:
        self.data = data
        self.where = where
        self.head_dim_from_hidden = head_dim_from_hidden

    def error(self, key: str, problem: str, fix: str) -> HFConfigError:
        return HFConfigError(f"{self.where}: field {key!r} {problem}; {fix}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str) -> Any:
        value = self.data.get(key)
        if value is None:
            raise self.error(key, "is missing", "add it to the config")
        return value

    def positive(self, key: str) -> int:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {value!r}", "write a whole number")
        if value <= 0:
            raise self.error(key, f"must be positive, got {value}", "set it to the model's real size")
        return value

    def entries(self, key: str) -> list[Any]:
        value = self.raw(key)
        if not isinstance(value, list | tuple):
            raise self.error(key, f"must be a list, got {type(value).__name__}", "write a JSON list")
        return list(value)

    def divides(self, key: str, num_key: str) -> tuple[int, int]:
        """``(data[num_key], data[key])`` where ``data[key]`` divides ``data[num_key]``."""
        num, den = self.positive(num_key), self.positive(key)
        if num % den:
            raise self.error(key, f"({den}) does not divide {num_key!r} ({num})", f"choose a divisor of {num}")
        return num, den

    def head_dim(self) -> int:
        if self.has("head_dim") or not self.head_dim_from_hidden:
            return self.positive("head_dim")
        hidden, heads = self.divides("num_attention_heads", "hidden_size")
        return hidden // heads

    def kv_heads(self) -> int:
        """``num_key_value_heads`` (GQA groups must divide the query heads)."""
        return self.divides("num_key_value_heads", "num_attention_heads")[1]


# --- kind builders: one per layer type --------------------------------------------------------------------------------


def _conv(name: str, channels: int, kernel: int, f: _Fields, kernel_key: str, dt: _Dtypes) -> StateTensor:
    if kernel < 2:
        raise f.error(kernel_key, f"is {kernel}", "a causal conv keeps kernel - 1 inputs: use a kernel of 2 or more")
    return StateTensor(name, (channels, kernel - 1), dt.model, tp_dim=0)


def _convs(
    names: tuple[str, ...], channels: tuple[int, ...], kernel: int, f: _Fields, key: str, dt: _Dtypes
) -> tuple[StateTensor, ...]:
    """One conv window per component of a conv over their concatenation (same bytes as one window)."""
    return tuple(_conv(name, c, kernel, f, key, dt) for name, c in zip(names, channels, strict=True))


def _full(f: _Fields, dt: _Dtypes) -> LayerKind:
    head_dim = f.head_dim()
    return FullAttention(f.kv_heads(), head_dim, head_dim)


def _sliding(f: _Fields, dt: _Dtypes) -> LayerKind:
    head_dim = f.head_dim()
    return SlidingWindow(f.positive("sliding_window"), f.kv_heads(), head_dim, head_dim)


def _mla(f: _Fields, dt: _Dtypes) -> LayerKind:
    return MLA(
        f.positive("kv_lora_rank"),
        f.positive("qk_rope_head_dim"),
        f.positive("num_attention_heads"),
        f.positive("v_head_dim"),
    )


def _gated_deltanet(f: _Fields, dt: _Dtypes) -> LayerKind:
    v_heads, k_heads = f.divides("linear_num_key_heads", "linear_num_value_heads")
    k_dim, v_dim = f.positive("linear_key_head_dim"), f.positive("linear_value_head_dim")
    kernel = f.positive("linear_conv_kernel_dim")
    channels = (k_heads * k_dim, k_heads * k_dim, v_heads * v_dim)  # conv over cat[q, k, v]
    return Linear(
        "gated_deltanet",
        (
            *_convs(("conv_q", "conv_k", "conv_v"), channels, kernel, f, "linear_conv_kernel_dim", dt),
            StateTensor("recurrent_state", (v_heads, k_dim, v_dim), dt.state, tp_dim=0),
        ),
    )


def _kda(f: _Fields, dt: _Dtypes) -> LayerKind:
    # Published configs nest these in ``linear_attn_config``; transformers' own config flattens them.
    nested = f.data.get("linear_attn_config") or {}
    sub = _Fields(nested, f"{f.where} linear_attn_config", False) if nested else None
    if sub is not None:
        heads, dim = sub.positive("num_heads"), sub.positive("head_dim")
        kernel, kernel_key = sub.positive("short_conv_kernel_size"), "linear_attn_config.short_conv_kernel_size"
    else:
        heads, dim = f.positive("linear_num_heads"), f.positive("linear_head_dim")
        kernel, kernel_key = f.positive("linear_conv_kernel_dim"), "linear_conv_kernel_dim"
    return Linear(
        "kda",
        (
            *_convs(("conv_q", "conv_k", "conv_v"), (heads * dim,) * 3, kernel, f, kernel_key, dt),  # 3 short convs
            StateTensor("recurrent_state", (heads, dim, dim), dt.state, tp_dim=0),
        ),
    )


def _mamba2(f: _Fields, dt: _Dtypes) -> LayerKind:
    heads, groups = f.divides("n_groups", "mamba_num_heads")
    head_dim, d_state = f.positive("mamba_head_dim"), f.positive("ssm_state_size")
    channels = (heads * head_dim, groups * d_state, groups * d_state)  # conv over cat[x, B, C]
    return Linear(
        "mamba2",
        (
            *_convs(("conv_x", "conv_B", "conv_C"), channels, f.positive("conv_kernel"), f, "conv_kernel", dt),
            StateTensor("ssm_state", (heads, head_dim, d_state), dt.state, tp_dim=0),
        ),
    )


def _mamba1(f: _Fields, dt: _Dtypes) -> LayerKind:
    d_inner = f.positive("mamba_expand") * f.positive("hidden_size")
    return Linear(
        "mamba1",
        (
            _conv("conv_state", d_inner, f.positive("mamba_d_conv"), f, "mamba_d_conv", dt),
            StateTensor("ssm_state", (d_inner, f.positive("mamba_d_state")), dt.state, tp_dim=0),
        ),
    )


def _lightning(f: _Fields, dt: _Dtypes) -> LayerKind:
    heads, head_dim = f.positive("num_attention_heads"), f.head_dim()
    return Linear("lightning", (StateTensor("kv_state", (heads, head_dim, head_dim), dt.state, tp_dim=0),))


def _no_cache(f: _Fields, dt: _Dtypes) -> LayerKind:
    return NoCache()


# --- layer-type readers: one per config convention --------------------------------------------------------------------


def _counted(f: _Fields, key: str, types: list[str]) -> list[str]:
    """``types`` (read from ``key``), checked against ``num_hidden_layers`` where the config states it."""
    if not types:
        raise f.error(key, "lists no layers", "give one entry per layer")
    if f.has("num_hidden_layers") and len(types) != f.positive("num_hidden_layers"):
        raise f.error(
            key,
            f"gives {len(types)} layers but 'num_hidden_layers' is {f.positive('num_hidden_layers')}",
            "make them agree (one entry per layer)",
        )
    return types


def _listed(key: str, *aliases: str) -> Callable[[_Fields], list[str]]:
    """The per-layer type names stored as a list under ``key`` (or one of ``aliases``)."""

    def read(f: _Fields) -> list[str]:
        name = next((k for k in (key, *aliases) if f.has(k)), key)
        return _counted(f, name, [str(t) for t in f.entries(name)])

    return read


def _listed_or(key: str, fallback: Callable[[_Fields], list[str]], *aliases: str) -> Callable[[_Fields], list[str]]:
    listed = _listed(key, *aliases)
    return lambda f: listed(f) if any(f.has(k) for k in (key, *aliases)) else fallback(f)


def _every(kind: str) -> Callable[[_Fields], list[str]]:
    return lambda f: [kind] * f.positive("num_hidden_layers")


def _interval(key: str, hit: str, other: str) -> Callable[[_Fields], list[str]]:
    """Layer ``i`` is ``hit`` iff ``(i + 1) % config[key] == 0`` (Qwen3-Next, Gemma 3)."""
    return lambda f: [hit if (i + 1) % f.positive(key) == 0 else other for i in range(f.positive("num_hidden_layers"))]


def _jamba_types(f: _Fields) -> list[str]:
    period, offset = f.positive("attn_layer_period"), f.raw("attn_layer_offset")
    if not isinstance(offset, int) or not 0 <= offset < period:
        raise f.error("attn_layer_offset", f"is {offset!r}", f"use 0 <= offset < attn_layer_period ({period})")
    return ["attention" if i % period == offset else "mamba" for i in range(f.positive("num_hidden_layers"))]


_NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _nemotron_pattern(f: _Fields) -> list[str]:
    pattern = f.raw("hybrid_override_pattern")
    unknown = sorted(set(str(pattern)) - set(_NEMOTRON_PATTERN))
    if unknown:
        raise f.error(
            "hybrid_override_pattern", f"has unknown symbols {unknown}", f"use only {list(_NEMOTRON_PATTERN)}"
        )
    return _counted(f, "hybrid_override_pattern", [_NEMOTRON_PATTERN[c] for c in str(pattern)])


def _kimi_layers(f: _Fields) -> list[str]:
    """``linear_attn_config.full_attn_layers`` / ``kda_layers``: 1-based ids covering every layer once."""
    n = f.positive("num_hidden_layers")
    nested = _Fields(f.raw("linear_attn_config"), f"{f.where} linear_attn_config", False)
    types: list[str | None] = [None] * n
    for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
        for layer in nested.entries(key):
            if not isinstance(layer, int) or not 1 <= layer <= n:
                raise nested.error(key, f"holds {layer!r}", f"layer ids are 1-based, 1..{n} (num_hidden_layers)")
            if types[layer - 1] is not None:
                raise nested.error(key, f"repeats layer {layer}", "list each layer in exactly one of the two lists")
            types[layer - 1] = kind
    missing = [i + 1 for i, t in enumerate(types) if t is None]
    if missing:
        raise nested.error(
            "kda_layers", f"and 'full_attn_layers' leave layers {missing[:8]} without a kind", "list every layer"
        )
    return [t for t in types if t is not None]


def _minimax_types(f: _Fields) -> list[str]:
    """MiniMax-M1's ``attn_type_list``: 0 lightning (linear), 1 softmax attention."""
    names = {0: "linear_attention", 1: "full_attention"}
    values = f.entries("attn_type_list")
    bad = sorted({repr(v) for v in values if v not in names})
    if bad:
        raise f.error("attn_type_list", f"holds {bad}", "use 0 (lightning) or 1 (softmax attention)")
    return _counted(f, "attn_type_list", [names[v] for v in values])


# --- the table --------------------------------------------------------------------------------------------------------

KindBuilder = Callable[[_Fields, _Dtypes], LayerKind]


@dataclass(frozen=True)
class _Arch:
    layer_types: Callable[[_Fields], list[str]]
    kinds: Mapping[str, KindBuilder]
    head_dim_from_hidden: bool = False


_GDN_HYBRID = _Arch(
    _listed_or("layer_types", _interval("full_attention_interval", "full_attention", "linear_attention")),
    {"full_attention": _full, "linear_attention": _gated_deltanet},
)
_GEMMA3 = _Arch(
    _listed_or("layer_types", _interval("sliding_window_pattern", "full_attention", "sliding_attention")),
    {"full_attention": _full, "sliding_attention": _sliding},
)

_ARCHITECTURE_TABLE: dict[str, _Arch] = {
    "qwen3_next": _GDN_HYBRID,
    "qwen3_5_text": _GDN_HYBRID,
    "qwen3_5_moe_text": _GDN_HYBRID,
    "gemma3_text": _GEMMA3,
    "gpt_oss": _Arch(_listed("layer_types"), {"full_attention": _full, "sliding_attention": _sliding}),
    "nemotron_h": _Arch(
        _listed_or("layers_block_type", _nemotron_pattern, "layer_types"),
        {
            "mamba": _mamba2,
            "linear_attention": _mamba2,
            "attention": _full,
            "full_attention": _full,
            "mlp": _no_cache,
            "moe": _no_cache,
        },
    ),
    "kimi_linear": _Arch(
        _listed_or("layer_types", _kimi_layers),
        {"full_attention": _mla, "linear_attention": _kda},
    ),
    "llama": _Arch(_every("full_attention"), {"full_attention": _full}, head_dim_from_hidden=True),
    "deepseek_v3": _Arch(_every("mla"), {"mla": _mla}),
    "jamba": _Arch(_jamba_types, {"attention": _full, "mamba": _mamba1}, head_dim_from_hidden=True),
    "minimax": _Arch(
        _listed_or("layer_types", _minimax_types),
        {"full_attention": _full, "linear_attention": _lightning},
        head_dim_from_hidden=True,
    ),
}
_ARCHITECTURES = Registry("Hugging Face architecture (model_type)", _ARCHITECTURE_TABLE)
_ARCHITECTURES.add("minimax_m1", _ARCHITECTURES["minimax"])

_WRAPPERS = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
"""Multimodal configs whose ``text_config`` holds the language model, with its ``model_type``."""


# --- entry point ------------------------------------------------------------------------------------------------------


def from_hf_config(
    config: Any,
    *,
    name: str | None = None,
    kv_dtype: str | torch.dtype | None = None,
    state_dtype: str | torch.dtype | None = None,
) -> ModelSpec:
    """The ``ModelSpec`` of a Hugging Face model config.

    ``config``: a ``transformers`` config object, a config dict, or a ``config.json`` path (str or Path).
    ``name`` defaults to the config's ``_name_or_path``, else the folder of the path, else ``model_type``.
    ``kv_dtype`` / ``state_dtype`` override the KV and recurrent-matrix dtypes (see the module docstring).
    """
    data, where, source = _load(config)
    name = name or data.get("_name_or_path") or (Path(source).parent.name if source else "") or None
    source = source or str(data.get("_name_or_path") or "")
    model_type = data.get("model_type")
    if model_type in _WRAPPERS:
        text = data.get("text_config")
        if not isinstance(text, Mapping):
            raise HFConfigError(f"{where}: field 'text_config' is missing; a {model_type} config nests its model there")
        inherited = {k: data[k] for k in ("dtype", "torch_dtype") if data.get(k) is not None}
        where, model_type = f"{where} text_config", text.get("model_type") or _WRAPPERS[model_type]
        data = {**inherited, **{k: v for k, v in text.items() if v is not None}, "model_type": model_type}
    arch = _ARCHITECTURES.get(str(model_type))
    if arch is None:
        raise HFConfigError(
            f"{where}: field 'model_type' is {model_type!r}, which hybridkv cannot read; "
            f"supported: {', '.join(sorted([*_ARCHITECTURES, *_WRAPPERS]))}"
        )
    f = _Fields(data, f"{model_type} config ({where})", arch.head_dim_from_hidden)
    dtypes = _dtypes(f, kv_dtype, state_dtype)

    types = arch.layer_types(f)
    unknown = sorted(set(types) - set(arch.kinds))
    if unknown:
        raise f.error("layer_types", f"holds unknown types {unknown}", f"use only {sorted(arch.kinds)}")
    built = {t: arch.kinds[t](f, dtypes) for t in sorted(set(types))}
    kimi = f.has("model_max_length") and not f.has("max_position_embeddings")  # Kimi's config names it so
    context_key = "model_max_length" if kimi else "max_position_embeddings"
    max_context = f.positive(context_key)
    return ModelSpec.from_kinds(
        name or str(model_type), [built[t] for t in types], kv_dtype=dtypes.kv, max_context=max_context, source=source
    )


def _load(config: Any) -> tuple[dict[str, Any], str, str]:
    """``(fields, where, source path)`` of any accepted config form."""
    if isinstance(config, str | Path):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        return read_config_json(path), str(path), str(path)  # its fields checked (hf_schema)
    if isinstance(config, Mapping):
        check_fields(config, "config dict")
        return dict(config), "config dict", ""
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict) and hasattr(config, "model_type"):
        data = dict(to_dict())
        check_fields(data, type(config).__name__)
        return data, f"{type(config).__name__}", ""
    raise HFConfigError(f"expected a transformers config, a dict or a config.json path, got {type(config).__name__}")


def _dtype(f: _Fields, key: str, value: Any) -> torch.dtype:
    try:
        return parse_dtype(value if isinstance(value, torch.dtype) else str(value).removeprefix("torch."))
    except ValueError as exc:
        raise f.error(key, f"is {value!r}", str(exc)) from None


def _dtypes(f: _Fields, kv_dtype: str | torch.dtype | None, state_dtype: str | torch.dtype | None) -> _Dtypes:
    key = "dtype" if f.has("dtype") else "torch_dtype"
    model = _dtype(f, key, f.raw(key)) if f.has(key) else torch.bfloat16
    state_key = next((k for k in ("mamba_ssm_dtype", "mamba_ssm_cache_dtype") if f.has(k)), None)
    state = torch.float32
    if state_dtype is not None:
        state = _dtype(f, "state_dtype", state_dtype)
    elif state_key is not None:
        state = _dtype(f, state_key, f.raw(state_key))
    kv = model if kv_dtype is None else _dtype(f, "kv_dtype", kv_dtype)
    return _Dtypes(model=model, kv=kv, state=state)
