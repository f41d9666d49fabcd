"""Weights: from a ``transformers`` model's ``state_dict`` or a local ``config.json`` + ``*.safetensors`` dir.

Invariants:
- Every parameter of the engine's model is loaded exactly once; a missing weight, an HF
  name the model cannot place, or a wrong shape raises ``WeightError`` naming every
  offender (the model is left untouched then).
- Checkpoint layouts that differ from ``state_dict`` (per-expert MoE weights) are merged by
  the model's ``merge_checkpoint`` first.
- Safetensors files are read with ``safetensors`` itself; ``transformers`` only parses
  ``config.json`` (it fills the architecture's defaults).
- A pipeline stage or tensor-parallel rank (``build_model(..., layers=, tp=)``) loads only
  its own part: names ``local_name`` drops are never read; a sharded parameter takes its
  ``Part`` of the full tensor (a tensor already cut to the part, as ``read_safetensors``
  reads it for a model, is taken as is; tensors fused at load, per-expert MoE weights and
  split convs, are read cut too: ``CausalLM.checkpoint_part``); a ``Part.zeros``
  parameter (a row-parallel bias off TP rank 0) is zero and its tensor is not read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridkv.engine.models.base import CausalLM, WeightError
from hybridkv.engine.registry import model_class, text_config
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel


def _listing(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def load_weights(model: CausalLM, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named ``tensors`` (``state_dict`` or checkpoint layout) into ``model`` after checking them."""
    tensors = model.merge_checkpoint(tensors)
    params = dict(model.named_parameters())
    parts = model.tp_parts()
    zeros = {name for name, part in parts.items() if part.is_zeros}  # held by another rank: never read
    placed: dict[str, torch.Tensor] = {name: torch.zeros_like(params[name]) for name in zeros}
    unexpected, doubled, shapes = [], [], []
    misshapen: set[str] = set()
    for hf_name, tensor in tensors.items():
        local = model.local_name(hf_name)
        if local is None or local in zeros:
            continue
        part = parts.get(local)
        if (
            part is not None
            and local in params
            and tensor.dim() > part.dim
            and tensor.shape[part.dim] in (part.full, part.size)
        ):
            tensor = part.take(tensor)
        if local not in params:
            unexpected.append(hf_name)
        elif local in placed:
            doubled.append(hf_name)
        elif tuple(tensor.shape) != tuple(params[local].shape):
            shapes.append(f"{hf_name} {tuple(tensor.shape)} (model {local} wants {tuple(params[local].shape)})")
            misshapen.add(local)
        else:
            placed[local] = tensor
    missing = sorted(set(params) - set(placed) - misshapen)
    problems = []
    if missing:
        problems.append(f"missing weights for {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected weights {_listing(unexpected)}")
    if doubled:
        problems.append(f"weights given twice under other names: {_listing(doubled)}")
    if shapes:
        problems.append(f"wrong shapes: {_listing(shapes)}")
    if problems:
        raise WeightError(f"{type(model).__name__}: " + "; ".join(problems))
    with torch.no_grad():
        for name, tensor in placed.items():
            params[name].copy_(tensor)


def read_safetensors(directory: str | Path, model: CausalLM | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``directory/*.safetensors`` (a name in two files is an error).

    With ``model`` (a stage / TP shard): only the tensors it loads, and of a sharded
    parameter only its part (read range by range, never the whole tensor).
    """
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightError(f"{directory}: no *.safetensors files")
    parts = model.tp_parts() if model is not None else {}
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name in tensors:
                    raise WeightError(f"{directory}: weight {name} appears in two files (second: {path.name})")
                if model is not None and model.local_name(name) is None:
                    continue
                part = model.checkpoint_part(name, parts) if model is not None else None
                if part is None:
                    tensors[name] = f.get_tensor(name)
                elif part.is_zeros:
                    continue
                else:
                    lazy = f.get_slice(name)
                    ndim = len(lazy.get_shape())
                    tensors[name] = torch.cat([lazy[index] for index in part.slices(ndim)], dim=part.dim)
    return tensors


def read_config(directory: str | Path) -> Any:
    from transformers import AutoConfig

    path = Path(directory)
    if not (path / "config.json").is_file():
        raise WeightError(f"{directory}: no config.json")
    return AutoConfig.from_pretrained(str(path))


def build_model(
    config: Any,
    tensors: Mapping[str, torch.Tensor] | Callable[[CausalLM], Mapping[str, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    layers: tuple[int, int] | None = None,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """The engine's model for ``config`` with its weights loaded, in ``dtype`` on ``device``.

    ``tensors``: HF-named tensors, or a function of the (empty) model that reads them (so a
    shard can read only its part). ``layers`` / ``tp``: a pipeline stage's ``[start, end)``
    and a tensor-parallel rank (default: the whole model).
    """
    config = text_config(config)
    with torch.device(device):
        model = model_class(config.model_type)(config, layers, tp)
    load_weights(model, tensors(model) if callable(tensors) else tensors)
    return model.to(dtype).eval()


def from_hf_model(hf_model: Any, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    return build_model(hf_model.config, hf_model.state_dict(), dtype, device)


def from_directory(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    return build_model(read_config(directory), read_safetensors(directory), dtype, device)
