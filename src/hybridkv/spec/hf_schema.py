"""The types and ranges of a Hugging Face config's fields, checked before any of them is used.

A config.json comes from whoever published the model directory; ``transformers`` accepts a
negative ``vocab_size`` and then ``torch`` fails deep inside a layer's constructor, or refuses a
mistyped field with its own exception types. ``check_fields`` refuses such a config first, with
an ``HFConfigError`` naming the field, what it must be and the value found.

Invariants:
- ``read_config_json`` reads at most ``MAX_CONFIG_BYTES`` and refuses JSON nested deeper than
  ``MAX_DEPTH`` (checked iteratively: no recursion on input); the result is a JSON object.
- Every field of ``_FIELDS`` present and not null in the config (and in its ``text_config``,
  ``linear_attn_config`` and rope dicts) has its type and range: sizes are integers in
  ``[1, MAX_SIZE]`` (``bool`` is not an integer), counts ``[0, MAX_SIZE]``, epsilons and rope
  bases finite numbers above 0, flags booleans, dtypes names ``parse_dtype`` knows, and the
  ``bos`` / ``eos`` token ids integers in ``[0, vocab_size)``. Fields not in the table are not
  checked (each architecture has its own; the spec and the models read theirs through
  ``hf_config._Fields`` or after this check).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hybridkv.spec.layers import parse_dtype


class HFConfigError(ValueError):
    """A Hugging Face config that cannot describe a model: unknown architecture, missing or bad field."""


MAX_CONFIG_BYTES = 16 << 20  # published configs are kilobytes
MAX_DEPTH = 32  # published configs nest 3 or 4 levels
MAX_SIZE = (1 << 31) - 1  # any dimension, count or context of a real model fits int32

Check = Callable[[Any], str | None]  # the problem with a value, or None


def _integer(low: int) -> Check:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be an integer"
        if value < low:
            return "must be positive" if low == 1 else f"must be at least {low}"
        if value > MAX_SIZE:
            return f"must be at most {MAX_SIZE}"
        return None

    return check


def _number(low: float, high: float = math.inf, *, closed_high: bool = False) -> Check:
    def check(value: Any) -> str | None:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not (low < value < high or (closed_high and value == high)):
            top = f" and at most {high}" if closed_high else ("" if high == math.inf else f" and below {high}")
            return f"must be a finite number above {low}{top}"
        return None

    return check


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def _dtype(value: Any) -> str | None:
    try:
        parse_dtype(str(value).removeprefix("torch.") if isinstance(value, str) else value)
    except (ValueError, TypeError) as exc:
        return f"is {value!r}: {exc}"
    return None


def _list_of(check: Check) -> Check:
    def checked(value: Any) -> str | None:
        if not isinstance(value, list):
            return "must be a list"
        bad = next((v for v in value if check(v) is not None), None)
        return None if bad is None else f"holds {bad!r}, which {check(bad)}"

    return checked


def _any_integer(value: Any) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"


_SIZE, _COUNT = _integer(1), _integer(0)
_EPS = _number(0.0)

_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "model_max_length",
    "original_max_position_embeddings",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "num_experts_per_token",
    "n_routed_experts",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "linear_num_heads",
    "linear_head_dim",
    "sliding_window",
    "sliding_window_pattern",
    "full_attention_interval",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "qk_head_dim",
    "v_head_dim",
    "mamba_num_heads",
    "mamba_head_dim",
    "ssm_state_size",
    "n_groups",
    "conv_kernel",
    "expand",
    "mamba_expand",
    "mamba_d_conv",
    "mamba_d_state",
    "attn_layer_period",
    "decoder_sparse_step",
    "n_group",
    "topk_group",
    "num_expert_group",
    "num_heads",
    "short_conv_kernel_size",
)
_COUNTS = (
    "n_shared_experts",
    "num_shared_experts",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
    "attn_layer_offset",
)
_EPSILONS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "rope_theta", "factor")
_FLAGS = (
    "tie_word_embeddings",
    "attention_bias",
    "norm_topk_prob",
    "mlp_bias",
    "use_bias",
    "use_conv_bias",
    "residual_in_fp32",
)

_FIELDS: dict[str, Check] = {
    **dict.fromkeys(_SIZES, _SIZE),
    **dict.fromkeys(_COUNTS, _COUNT),
    **dict.fromkeys(_EPSILONS, _EPS),
    **dict.fromkeys(_FLAGS, _flag),
    **dict.fromkeys(("dtype", "torch_dtype", "mamba_ssm_dtype", "mamba_ssm_cache_dtype"), _dtype),
    "partial_rotary_factor": _number(0.0, 1.0, closed_high=True),
    "model_type": _text,
    "hidden_act": _text,
    "layer_types": _list_of(_text),
    "mlp_only_layers": _list_of(_COUNT),
    "pad_token_id": _any_integer,
}
_TOKEN_IDS = ("bos_token_id", "eos_token_id")
_NESTED = ("text_config", "linear_attn_config", "rope_parameters", "rope_scaling")


def _token_ids(value: Any, vocab: int | None) -> str | None:
    ids = value if isinstance(value, list) else [value]
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (vocab and token >= vocab):
            within = f"[0, {vocab})" if vocab else "0 or more"
            return f"must be a token id in {within} or a list of them"
    return None


def check_fields(data: Mapping[str, Any], where: str) -> None:
    """``HFConfigError`` naming the first field of ``data`` (or of a nested config) out of type or range."""
    _check_depth(data, where)
    _check(data, where)


def _check(data: Mapping[str, Any], where: str) -> None:
    for key, value in data.items():
        check = _FIELDS.get(key)
        if value is None or check is None:
            continue
        problem = check(value)
        if problem is not None:
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            detail = problem if problem.startswith("is ") else f"{problem}, got {shown}"
            raise HFConfigError(f"{where}: field {key!r} {detail}; fix it in the config")
    vocab = data.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None
    for key in _TOKEN_IDS:
        if data.get(key) is not None:
            problem = _token_ids(data[key], vocab)
            if problem is not None:
                raise HFConfigError(f"{where}: field {key!r} {problem}, got {data[key]!r}; fix it in the config")
    for key in _NESTED:
        nested = data.get(key)
        if isinstance(nested, Mapping):
            _check(nested, f"{where} {key}")
            for sub, value in nested.items():  # rope dicts per layer type (Gemma 3)
                if key.startswith("rope") and isinstance(value, Mapping):
                    _check(value, f"{where} {key}.{sub}")
        elif nested is not None:
            raise HFConfigError(f"{where}: field {key!r} must be an object, got {type(nested).__name__}")


def _check_depth(data: Any, where: str) -> None:
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise HFConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels; a model config is a few levels deep")
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list | tuple):
            stack.extend((v, depth + 1) for v in value)


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The JSON object of config file ``path`` (at most ``MAX_CONFIG_BYTES``, ``MAX_DEPTH`` levels),
    its fields checked (``check_fields``); ``HFConfigError`` naming the file otherwise."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise HFConfigError(f"cannot read config {str(path)!r}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise HFConfigError(f"config {str(path)!r} is larger than {MAX_CONFIG_BYTES >> 20} MiB; a config is kilobytes")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise HFConfigError(
            f"config {str(path)!r}: nested deeper than {MAX_DEPTH} levels; a model config is a few levels deep"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFConfigError(f"config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"config {str(path)!r} must hold a JSON object, not {type(data).__name__}")
    check_fields(data, f"config {str(path)!r}")
    return data
