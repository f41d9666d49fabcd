"""Weights: from a ``transformers`` model's ``state_dict`` or a local ``config.json`` + ``*.safetensors`` dir.

Invariants:
- Every parameter of the engine's model is loaded exactly once; a missing weight, an HF
  name the model cannot place, or a wrong shape raises ``WeightError`` naming every
  offender, and a weight holding NaN or inf raises ``NonFiniteWeightError`` naming the
  tensors (the model is left untouched then).
- ``build_model`` allocates nothing the size of the config before the weights fit it: the
  config's fields are checked (``spec.hf_schema``), the model is built on the meta device,
  the weights are matched against it (names, shapes, finite values), the device must hold
  the parameters (``memory.host.check_fits``), and only then is each parameter
  materialised from its checkpoint tensor (on ``device``, in ``dtype``).
- A ``*.safetensors`` file is checked from its header before any tensor data is read
  (``safetensors_header``): a truncated or foreign file is a ``WeightError`` naming it; with
  a model, the shapes it declares are matched against the model, and the bytes to read
  must fit in host memory, before reading.
- Checkpoint layouts that differ from ``state_dict`` (per-expert MoE weights) are merged by
  the model's ``merge_checkpoint`` first.
- Safetensors files are read with ``safetensors`` itself; ``transformers`` only parses
  ``config.json`` (it fills the architecture's defaults) after its fields passed the schema.
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
from torch import nn

from hybridkv.engine.errors import WeightError
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.registry import architectures, model_class, text_config
from hybridkv.engine.safetensors_header import TensorInfo, read_header
from hybridkv.engine.tensor_parallel import SINGLE, Part, TensorParallel
from hybridkv.memory.host import check_fits
from hybridkv.spec import dtype_name
from hybridkv.spec.hf_schema import HFConfigError, check_fields, read_config_json


class NonFiniteWeightError(WeightError):
    """Weights holding NaN or inf: a corrupt checkpoint, or one saved after training diverged."""


def _listing(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_weights(model: CausalLM, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{parameter name: tensor}`` for every parameter of ``model`` that is read (a ``Part.zeros`` one is
    not), from HF-named ``tensors`` (``state_dict`` or checkpoint layout; meta tensors check shapes only);
    ``WeightError`` naming every missing, unexpected, doubled or misshapen weight, then
    ``NonFiniteWeightError`` naming the tensors that hold NaN or inf. Reads nothing into ``model``."""
    tensors = model.merge_checkpoint(tensors)
    params = dict(model.named_parameters())
    parts = model.tp_parts()
    zeros = {name for name, part in parts.items() if part.is_zeros}  # held by another rank: never read
    placed: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
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
            placed[local], source[local] = tensor, hf_name
    missing = sorted(set(params) - set(placed) - misshapen - zeros)
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
    bad = [
        source[name]
        for name, t in placed.items()
        if t.is_floating_point() and not t.is_meta and not bool(torch.isfinite(t).all())  # once, at load
    ]
    if bad:
        raise NonFiniteWeightError(
            f"{type(model).__name__}: non-finite weights (NaN or inf) in {_listing(sorted(bad))}; the checkpoint "
            "is corrupt or was saved after training diverged"
        )
    return placed


def load_weights(model: CausalLM, tensors: Mapping[str, torch.Tensor], device: str | torch.device = "cpu") -> None:
    """Load HF-named ``tensors`` into ``model`` after checking them (``check_weights``): copied into its
    parameters, or, for parameters on the meta device, materialised from them on ``device`` (same dtype)."""
    _place(model, check_weights(model, tensors), torch.device(device))


def _place(
    model: CausalLM, placed: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype | None = None
) -> None:
    """Copy ``placed`` into ``model``'s parameters; a meta parameter is replaced by a new one made from its
    tensor on ``device`` (floating point ones in ``dtype`` when given, else the parameter's dtype)."""
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            tensor = placed.get(name)
            if not param.is_meta:
                if tensor is None:  # a Part.zeros parameter: another rank holds it
                    param.zero_()
                else:
                    param.copy_(tensor)
                continue
            kind = dtype if dtype is not None and param.is_floating_point() else param.dtype
            if tensor is None:
                value = torch.zeros(param.shape, dtype=kind, device=device)
            else:
                value = tensor.to(device=device, dtype=kind, copy=True)
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._parameters[leaf] = nn.Parameter(value, requires_grad=param.requires_grad)


def _wanted(directory: str | Path, model: CausalLM | None) -> dict[str, tuple[Path, TensorInfo, Part | None]]:
    """What a read of ``directory`` for ``model`` takes: per checkpoint name, its file, header entry and the
    part of it ``model`` holds (None: all of it). Every file's header is checked; with ``model`` the declared
    shapes are matched against it (``WeightError`` naming the weights) before anything is read."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightError(f"{directory}: no *.safetensors files")
    parts = model.tp_parts() if model is not None else {}
    wanted: dict[str, tuple[Path, TensorInfo, Part | None]] = {}
    for path in files:
        for name, info in read_header(path).items():
            if name in wanted:
                raise WeightError(f"{directory}: weight {name} appears in two files (second: {path.name})")
            if model is not None and model.local_name(name) is None:
                continue
            part = model.checkpoint_part(name, parts) if model is not None else None
            if part is None or not part.is_zeros:
                wanted[name] = (path, info, part)
    if model is not None:
        check_weights(model, {name: _meta_part(info, part) for name, (_, info, part) in wanted.items()})
    return wanted


def check_safetensors(directory: str | Path, model: CausalLM) -> int:
    """The bytes ``read_safetensors(directory, model)`` would read; ``WeightError`` naming the file or the
    weights unless every header is sound and declares exactly the names and shapes ``model`` (a stage / TP
    shard, e.g. built on the meta device) loads. Reads headers only: no tensor data."""
    return sum(_meta_part(info, part).nbytes for _, info, part in _wanted(directory, model).values())


def read_safetensors(directory: str | Path, model: CausalLM | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``directory/*.safetensors`` (a name in two files is an error).

    Every file's header is checked first (``safetensors_header``). With ``model`` (a stage / TP
    shard): only the tensors it loads, and of a sharded parameter only its part (read range by
    range, never the whole tensor); their declared shapes are matched against ``model`` before any
    data is read (``check_safetensors``). The bytes to read must fit in host memory.
    """
    from safetensors import SafetensorError, safe_open

    wanted = _wanted(directory, model)
    files = sorted({path for path, _, _ in wanted.values()})
    nbytes = sum(_meta_part(info, part).nbytes for _, info, part in wanted.values())
    check_fits(nbytes, "cpu", f"reading the weights of {directory}", "free host memory or use a smaller model")
    tensors: dict[str, torch.Tensor] = {}
    try:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    if name not in wanted:
                        continue
                    part = wanted[name][2]
                    if part is None:
                        tensors[name] = f.get_tensor(name)
                    else:
                        lazy = f.get_slice(name)
                        ndim = len(lazy.get_shape())
                        tensors[name] = torch.cat([lazy[index] for index in part.slices(ndim)], dim=part.dim)
    except SafetensorError as exc:  # changed on disk since its header was checked
        raise WeightError(f"{directory}: cannot read its weights: {exc}") from None
    return tensors


def _meta_part(info: TensorInfo, part: Part | None) -> torch.Tensor:
    """The (meta) tensor a rank reads of a checkpoint tensor: all of it, or its ``part``."""
    meta = info.meta()
    if part is None:
        return meta
    return torch.cat([meta[index] for index in part.slices(meta.dim())], dim=part.dim)


def read_config(directory: str | Path) -> Any:
    """The ``transformers`` config of ``directory/config.json``, its fields checked (``spec.hf_schema``) first;
    ``HFConfigError`` when they fail or ``transformers`` refuses the file."""
    from transformers import AutoConfig

    path = Path(directory)
    if not (path / "config.json").is_file():
        raise WeightError(f"{directory}: no config.json")
    read_config_json(path / "config.json")
    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # its own validation errors: what it says is about the user's file
        raise HFConfigError(f"{path / 'config.json'}: transformers cannot read it: {exc}") from None


def empty_model(config: Any, layers: tuple[int, int] | None = None, tp: TensorParallel = SINGLE) -> CausalLM:
    """The engine's model for ``config`` on the meta device: shapes, no data (nothing allocated)."""
    config = text_config(config)
    check_fields(config.to_dict(), f"{config.model_type} config")
    if config.model_type not in architectures():
        raise HFConfigError(
            f"the engine has no model for model_type {config.model_type!r}; it serves {architectures()}"
        )
    try:
        with torch.device("meta"):
            return model_class(config.model_type)(config, layers, tp)
    except (RuntimeError, OverflowError) as exc:  # on meta only shapes can fail: the config's sizes
        raise HFConfigError(f"{config.model_type} config: its sizes give tensors torch cannot make ({exc})") from None


def build_model(
    config: Any,
    tensors: Mapping[str, torch.Tensor] | Callable[[CausalLM], Mapping[str, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    layers: tuple[int, int] | None = None,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """The engine's model for ``config`` with its weights loaded, in ``dtype`` on ``device``.

    ``tensors``: HF-named tensors, or a function of the (empty, meta) model that reads them (so a
    shard can read only its part). ``layers`` / ``tp``: a pipeline stage's ``[start, end)`` and a
    tensor-parallel rank (default: the whole model). Nothing the size of the model is allocated
    before its weights are checked against it and the device can hold them.
    """
    model = empty_model(config, layers, tp)
    placed = check_weights(model, tensors(model) if callable(tensors) else tensors)
    params = list(model.parameters())
    nbytes = sum(p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size()) for p in params)
    check_fits(nbytes, device, f"the weights of {type(model).__name__} in {dtype_name(dtype)}", "use a smaller model")
    _place(model, placed, torch.device(device), dtype)
    return model.to(device=device, dtype=dtype).eval()


def from_hf_model(hf_model: Any, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    return build_model(hf_model.config, hf_model.state_dict(), dtype, device)


def from_directory(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    return build_model(read_config(directory), lambda model: read_safetensors(directory, model), dtype, device)
