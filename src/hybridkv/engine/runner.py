"""ShardRunner: one process's part of a model layout runs one ``ForwardBatch`` over its ``UnifiedMemory``.

The one runner of every engine: a single-process ``Engine`` is a 1x1 layout (the whole model, no process
groups); a PP stage or a TP rank of a parallel or disaggregated engine holds its shard and the layout's
``StageGroups``. ``ShardRunner(model, mem, groups)`` runs a model built for the memory; ``build_runner``
reads a model's config, its weights (only this shard's part) and an ``EngineConfig`` and builds both.

Invariants:
- The memory's views have exactly the shapes the shard's layers read and write (``check_memory``, at
  construction): a wrong split fails before any step runs.
- Ids are translated once per step, inside ``run_stage``, after the caller made every allocation of the
  step; no physical id outlives the step (compaction may move cells between steps).
- A request's state slot is read at its ``prefix_lens`` and holds the state after its last new token when
  the step returns (zeroed first when ``fresh_state``).
- Every rank of a layout runs the same schedule with its own ``RequestKV`` over its own memory
  (virtual ids differ per rank; token counts do not). ``forward`` returns the same logits on every rank
  (the last stage's TP rank 0 broadcasts them); ``run_stage`` returns this stage's own output without the
  broadcast (hidden states on earlier stages). Hidden states cross stages as ``(T, hidden)`` in the model
  dtype; the receiver knows ``T`` from its own batch.
- A step runs under ``torch.inference_mode`` (no autograd bookkeeping on any op: about 7% of the engine's
  CPU on the tiny models, against ``no_grad``); what outlives a step (the gather workspace, weights derived
  once, cached masks) is made a normal tensor, so the modules stay usable outside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridkv.engine.config import DEFAULT_CONFIG, EngineConfig
from hybridkv.engine.forward.batch import BatchError, ForwardBatch
from hybridkv.engine.forward.step import build_step
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.parallel.groups import StageGroups
from hybridkv.engine.registry import engine_spec, text_config
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel
from hybridkv.engine.weights import build_model, read_config, read_safetensors
from hybridkv.memory import UnifiedMemory
from hybridkv.memory.host import check_fits
from hybridkv.spec import IdSpace, KindTag, Parallel, ShardSpec

Weights = Mapping[str, torch.Tensor] | str | Path


class MemoryLayoutError(ValueError):
    """A memory whose views do not have the shapes the model's layers need."""


def check_memory(model: CausalLM, mem: UnifiedMemory) -> None:
    """Every layer of ``model`` finds exactly its tensors, in exactly its shapes, in ``mem``.

    Layers state their needs with ``memory_shapes()`` (per token for K/V and latents, per
    request for state); a layer without it keeps nothing.
    """
    needs: dict[int, dict[str, tuple[int, ...]]] = {}
    for module in model.modules():
        shapes = getattr(module, "memory_shapes", None)
        if callable(shapes):
            needs[int(getattr(module, "layer_id"))] = shapes()  # noqa: B009 (nn.Module attribute, untyped)
    problems = []
    for layer_id in model.layer_ids:
        have: dict[str, tuple[int, ...]] = {}
        if mem.shard.local_kind(layer_id).tag is not KindTag.NONE:
            state = mem.pool_of_layer(layer_id).layout.id_space is IdSpace.SLOT
            tensors = mem.geometry(layer_id)["tensors"]
            assert isinstance(tensors, dict)
            have = {name: tuple(shape if state else shape[1:]) for name, (shape, _) in tensors.items()}
        want = needs.get(layer_id, {})
        if have != want:
            problems.append(f"layer {layer_id}: memory holds {have}, the layer needs {want}")
    if problems:
        raise MemoryLayoutError(
            f"{mem.shard.describe()}: " + "; ".join(problems) + " (build the memory and the model from one ShardSpec)"
        )


class ShardRunner:
    def __init__(self, model: CausalLM, mem: UnifiedMemory, groups: StageGroups | None = None):
        """``model``: built for ``mem``'s shard; ``groups``: the layout's process groups (needed when the layout
        has more than one process)."""
        check_memory(model, mem)
        layout = mem.shard.parallel
        if layout.pp_size * layout.tp_size > 1 and groups is None:
            raise ValueError(
                f"{mem.shard.describe()}: a layout of PP {layout.pp_size} x TP {layout.tp_size} needs its StageGroups"
            )
        self.model = model
        self.mem = mem
        self.groups = groups
        self.device = mem.device
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())

    @property
    def shard(self) -> ShardSpec:
        return self.mem.shard

    @property
    def first(self) -> bool:
        return self.model.first

    @property
    def last(self) -> bool:
        return self.model.last

    @torch.inference_mode()
    def run_stage(self, batch: ForwardBatch) -> torch.Tensor:
        """This stage's step: receive hidden states (not on the first stage), run its layers, send them on
        (not on the last). Returns the last stage's logits ``(R, vocab)``, else the hidden states sent."""
        if self.mem.slot_pools and batch.state_slots is None:
            raise BatchError(f"{self.mem.shard.describe()} has recurrent layers: give every request a state slot")
        ctx = build_step(batch, self.mem, self.device, self.model.attention_sinks)
        hidden = None
        if not self.first:
            assert self.groups is not None
            hidden = self.groups.recv_prev((batch.input_ids.size, self.model.hidden_size), self.dtype, self.device)
        out = self.model(ctx, self.mem, hidden)
        if not self.last:
            assert self.groups is not None
            self.groups.send_next(out)
        return out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Last-position logits ``(R, vocab)`` on every rank of the layout."""
        out = self.run_stage(batch)
        if self.groups is None:
            return out
        logits = (
            out
            if self.last
            else torch.empty(batch.prefix_lens.size, self.model.vocab_size, dtype=self.dtype, device=self.device)
        )
        return self.groups.broadcast_from_last(logits.contiguous())


def build_runner(
    model: Any,
    weights: Weights,
    config: EngineConfig = DEFAULT_CONFIG,
    parallel: Parallel | None = None,
    pp_rank: int = 0,
    tp_rank: int = 0,
    groups: StageGroups | None = None,
    *,
    mem: UnifiedMemory | None = None,
) -> ShardRunner:
    """The runner of rank (``pp_rank``, ``tp_rank``) of ``parallel`` (default: one process): its ``ShardSpec``,
    its memory (only its stage's layers, its heads and state shards) and its model shard.

    ``model``: a ``transformers`` config or a directory with ``config.json``; ``weights``: HF-named tensors or
    a ``*.safetensors`` directory (read partially: only this shard's part). ``config``: the engine's options;
    the runner reads its memory's (``gpu_memory``, ``page_size``, ``chunk_size``, ``max_context``) and the
    model's (``dtype``, ``device``, ``spec``). ``mem``: a memory built by the caller for exactly this rank's
    shard (e.g. in shared memory a transfer writes into); by default one of ``gpu_memory`` bytes is built here."""
    parallel = parallel or Parallel()
    if isinstance(model, str | Path):
        model = read_config(model)
    hf_config = text_config(model)
    if groups is not None and (groups.parallel, groups.pp_rank, groups.tp_rank) != (parallel, pp_rank, tp_rank):
        raise ValueError(
            f"groups are for {groups.parallel} pp {groups.pp_rank} tp {groups.tp_rank}, "
            f"the runner for {parallel} pp {pp_rank} tp {tp_rank}: build both from one layout"
        )
    spec = config.spec or engine_spec(hf_config, config.dtype)
    shard = ShardSpec(spec, parallel, pp_rank, tp_rank)
    if mem is not None and mem.shard != shard:
        raise ValueError(
            f"the memory given is for {mem.shard.describe()}, this runner is {shard.describe()}: "
            "build the memory from the runner's ShardSpec"
        )
    if mem is None:  # a budget the host cannot hold: a user error, before allocating
        check_fits(config.memory_bytes, config.device, f"the memory of {shard.describe()}", "lower gpu_memory")
        mem = UnifiedMemory.create(
            shard,
            config.memory_bytes,
            config.device,
            page_size=config.page_size,
            max_context=config.max_context or spec.max_context,
            chunk_tokens=config.chunk_size,
        )
    tp = TensorParallel(parallel.tp_size, tp_rank, groups.all_reduce) if parallel.tp_size > 1 and groups else SINGLE
    source = (lambda model: read_safetensors(weights, model)) if isinstance(weights, str | Path) else weights
    return ShardRunner(build_model(hf_config, source, config.dtype, mem.device, shard.bounds, tp), mem, groups)
