"""Model presets: published configs of real models, plus tiny models of every hybrid shape.

Invariants:
- Real presets are read from ``data/model_presets.json`` (published config facts with their
  sources; copied from the project's shared research, see ``data/README.md``); their names, and
  which preset a name means, come from ``hybridkv.catalogue`` (torch-free, for the CLI). Every layer
  id is assigned exactly one kind, and the per-token KV bytes we derive must equal the
  bytes the file states; a mismatch is a load error, not a warning.
- Tiny presets are small enough to run real tensors in tests (float32 unless a test needs
  mixed dtypes) and cover: dense, MLA, full+SWA, full+two SWA windows+state,
  full+GatedDeltaNet, MLA+KDA, Mamba2+MLP-only+full, lightning+full; they are exactly
  ``catalogue.TINY_PRESETS`` (any other set is a load error).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from hybridkv.catalogue import TINY_PRESETS, PresetError, published_records, resolve_preset
from hybridkv.registry import Registry, UnknownName
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
from hybridkv.spec.model import Layer, ModelSpec


def spec_from_record(record: dict[str, Any]) -> ModelSpec:
    """Convert one published preset record into a ``ModelSpec`` (validated)."""
    name = record.get("name", "<unnamed>")
    try:
        dtype = parse_dtype(record["dtype"])
        layers_info = record["layers"]
        base = int(layers_info["index_base"])
        num_layers = int(record["num_layers"])
        ids_by_kind: dict[str, list[int]] = layers_info["ids_by_kind"]
        max_context = int(record.get("max_context") or record["max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PresetError(f"preset {name!r}: missing or bad field: {exc}") from exc

    kinds: list[LayerKind | None] = [None] * num_layers
    for kind_name, ids in ids_by_kind.items():
        kind = _kind_from_record(name, kind_name, record)
        for raw_id in ids:
            layer_id = int(raw_id) - base
            if not 0 <= layer_id < num_layers:
                raise PresetError(
                    f"preset {name!r}: {kind_name} layer id {raw_id} outside {base}..{base + num_layers - 1}"
                )
            if kinds[layer_id] is not None:
                raise PresetError(f"preset {name!r}: layer {raw_id} is given two kinds")
            kinds[layer_id] = kind
    missing = [i + base for i, k in enumerate(kinds) if k is None]
    if missing:
        raise PresetError(f"preset {name!r}: layers {missing[:10]} have no kind")
    spec = ModelSpec(
        name=name,
        layers=tuple(Layer(i, k) for i, k in enumerate(kinds) if k is not None),
        kv_dtype=dtype,
        max_context=max_context,
        source=record.get("hf_id", ""),
    )
    _check_published_bytes(spec, record)
    return spec


_KindReader = Callable[[str, str, dict[str, Any]], LayerKind]
"""(preset name, kind name, the record's section for the kind) -> the layer kind."""


def _full(_: str, kind: str, s: dict[str, Any]) -> LayerKind:
    return FullAttention(s["num_kv_heads"], s["head_dim"], s["v_head_dim"])


def _sliding(_: str, kind: str, s: dict[str, Any]) -> LayerKind:
    return SlidingWindow(s["window"], s["num_kv_heads"], s["head_dim"], s["v_head_dim"])


def _mla(_: str, kind: str, s: dict[str, Any]) -> LayerKind:
    return MLA(s["kv_lora_rank"], s["qk_rope_head_dim"], s["num_heads"], s["v_head_dim"])


def _linear(name: str, kind: str, s: dict[str, Any]) -> LayerKind:
    return Linear(kind, tuple(_state_from_record(name, t) for t in s["state_tensors_per_layer"]))


def _no_cache(_: str, kind: str, s: dict[str, Any]) -> LayerKind:
    return NoCache()


_KINDS = Registry[tuple[str | None, _KindReader]]("layer kind")
"""Each layer kind a preset record names: the record section it reads (None: none) and its reader."""
_KINDS.add("full_attention", ("full_attention", _full))
_KINDS.add("sliding_attention", ("swa", _sliding))
_KINDS.add("mla", ("mla", _mla))
for _kind in ("gated_deltanet", "kda", "mamba1", "mamba2", "lightning"):
    _KINDS.add(_kind, ("linear", _linear))
_KINDS.add("mlp_only", (None, _no_cache))


def _kind_from_record(name: str, kind_name: str, record: dict[str, Any]) -> LayerKind:
    try:
        key, read = _KINDS[kind_name]
    except UnknownName as exc:
        raise PresetError(f"preset {name!r}: {exc}") from None
    section = record.get(key) if key is not None else {}
    if not isinstance(section, dict):
        raise PresetError(f"preset {name!r}: layers of kind {kind_name!r} need a {key!r} section")
    return read(name, kind_name, section)


def _state_from_record(name: str, tensor: dict[str, Any]) -> StateTensor:
    """One state tensor; its TP split is the record's own per-tensor fact: ``dims`` names each
    dimension of ``shape`` and ``tp_split`` the one TP ranks divide (null: replicated)."""
    label = f"preset {name!r}: state tensor {tensor.get('name')!r}"
    shape = tuple(int(d) for d in tensor["shape"])
    dims = tensor.get("dims")
    if "tp_split" not in tensor or not isinstance(dims, list) or len(dims) != len(shape):
        raise PresetError(
            f"{label} needs 'dims' (one name per dimension of shape {list(shape)}) and 'tp_split' "
            "(the dim name TP ranks divide, e.g. conv channels or heads; null if every rank holds it all)"
        )
    split = tensor["tp_split"]
    if split is not None and split not in dims:
        raise PresetError(f"{label}: tp_split {split!r} is not one of its dims {dims}")
    return StateTensor(
        tensor["name"], shape, parse_dtype(tensor["dtype"]), None if split is None else dims.index(split)
    )


def _check_published_bytes(spec: ModelSpec, record: dict[str, Any]) -> None:
    """The bytes we derive must match the bytes the preset publishes (bf16 figures)."""
    if spec.kv_dtype != torch.bfloat16:
        return
    for key in ("full_attention", "swa", "mla"):
        section = record.get(key)
        if not isinstance(section, dict):
            continue
        published = section.get("kv_bytes_per_token_per_layer_bf16")
        ids = record["layers"]["ids_by_kind"].get(
            {"full_attention": "full_attention", "swa": "sliding_attention", "mla": "mla"}[key], []
        )
        if published is None or not ids:
            continue
        derived = spec.layers[ids[0] - record["layers"]["index_base"]].kind.bytes_per_token(spec.kv_dtype)
        if derived != published:
            raise PresetError(
                f"preset {spec.name!r}: {key} KV bytes per token per layer derived as {derived} "
                f"but the preset states {published}; fix the head counts or dims"
            )
    linear = record.get("linear")
    if isinstance(linear, dict) and linear.get("state_bytes_per_layer") is not None:
        derived = [b for layer in spec.layers if (b := layer.kind.bytes_per_request(spec.kv_dtype))]
        if derived and derived[0] != linear["state_bytes_per_layer"]:
            raise PresetError(
                f"preset {spec.name!r}: state bytes per layer derived as {derived[0]} "
                f"but the preset states {linear['state_bytes_per_layer']}"
            )


# --- tiny presets -------------------------------------------------------------------------

F32 = torch.float32


def _convs(names: tuple[str, ...], channels: tuple[int, ...], dtype: torch.dtype = F32) -> tuple[StateTensor, ...]:
    """One kernel-4 conv window per component of a conv over their concatenation."""
    return tuple(StateTensor(n, (c, 3), dtype, tp_dim=0) for n, c in zip(names, channels, strict=True))


def _gdn(tp_heads: int = 4, dim: int = 8, conv_dtype: torch.dtype = F32) -> Linear:
    return Linear(
        "gated_deltanet",
        (
            *_convs(("conv_q", "conv_k", "conv_v"), (tp_heads * dim,) * 3, conv_dtype),
            StateTensor("recurrent_state", (tp_heads, dim, dim), F32, tp_dim=0),
        ),
    )


def _tiny_specs() -> dict[str, Callable[[], ModelSpec]]:
    full = FullAttention(4, 8, 8)
    swa8 = SlidingWindow(8, 4, 8, 8)
    swa24 = SlidingWindow(24, 2, 8, 8)
    mla = MLA(16, 4, 4, 8)
    mamba = Linear(
        "mamba2",
        (
            *_convs(("conv_x", "conv_B", "conv_C"), (32, 8, 8)),
            StateTensor("ssm_state", (4, 8, 4), F32, tp_dim=0),
        ),
    )
    kda = Linear(
        "kda",
        (
            *_convs(("conv_q", "conv_k", "conv_v"), (32, 32, 32)),
            StateTensor("recurrent_state", (4, 8, 8), F32, tp_dim=0),
        ),
    )
    lightning = Linear("lightning", (StateTensor("kv_state", (4, 8, 8), F32, tp_dim=0),))
    specs: dict[str, Callable[[], ModelSpec]] = {
        "tiny-dense": lambda: ModelSpec.from_kinds("tiny-dense", [full] * 4, kv_dtype=F32, max_context=256),
        "tiny-mla": lambda: ModelSpec.from_kinds("tiny-mla", [mla] * 4, kv_dtype=F32, max_context=256),
        "tiny-swa": lambda: ModelSpec.from_kinds(
            "tiny-swa", [swa8, swa8, swa8, full] * 2, kv_dtype=F32, max_context=256
        ),
        "tiny-swa2-state": lambda: ModelSpec.from_kinds(
            "tiny-swa2-state",
            [swa8, _gdn(), swa24, full, swa8, _gdn(), swa24, full],
            kv_dtype=F32,
            max_context=256,
        ),
        "tiny-gdn": lambda: ModelSpec.from_kinds(
            "tiny-gdn", [_gdn(), _gdn(), _gdn(), full] * 2, kv_dtype=F32, max_context=256
        ),
        "tiny-gdn-bf16": lambda: ModelSpec.from_kinds(
            "tiny-gdn-bf16",
            [_gdn(conv_dtype=torch.bfloat16)] * 3 + [full],
            kv_dtype=torch.bfloat16,
            max_context=256,
        ),
        "tiny-kda-mla": lambda: ModelSpec.from_kinds(
            "tiny-kda-mla", [kda, kda, kda, mla] * 2, kv_dtype=F32, max_context=256
        ),
        "tiny-mamba-mlp": lambda: ModelSpec.from_kinds(
            "tiny-mamba-mlp",
            [mamba, NoCache(), mamba, full, NoCache(), mamba, NoCache(), full],
            kv_dtype=F32,
            max_context=256,
        ),
        "tiny-lightning": lambda: ModelSpec.from_kinds(
            "tiny-lightning",
            [lightning, lightning, lightning, full] * 2,
            kv_dtype=F32,
            max_context=256,
        ),
    }
    if tuple(specs) != TINY_PRESETS:
        raise PresetError(
            f"the tiny presets built here ({', '.join(specs)}) differ from catalogue.TINY_PRESETS "
            f"({', '.join(TINY_PRESETS)}): list each tiny preset in both"
        )
    return specs


@cache
def get_preset(name: str) -> ModelSpec:
    """A preset by exact name, or by a unique case-insensitive substring of one (``catalogue.resolve_preset``)."""
    name = resolve_preset(name)
    tiny = _tiny_specs()
    if name in tiny:
        return tiny[name]()
    return spec_from_record(published_records()[name])


def published_record(name: str) -> dict[str, Any]:
    """The raw published facts of a real preset (sources, notes, derived figures)."""
    spec = get_preset(name)
    return published_records()[spec.name]
