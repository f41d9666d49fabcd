"""ModelRunner: runs one ForwardBatch through a model over UnifiedMemory.

Invariants:
- Ids are translated once per step, inside ``forward``, after the caller made every
  allocation of the step; no physical id outlives the step (compaction may move cells
  between steps).
- A request's state slot is read at its ``prefix_lens`` and holds the state after its last
  new token when ``forward`` returns (zeroed first when ``fresh_state``).
- The memory's views have exactly the shapes the model's layers read and write
  (``check_memory``, at construction).
- A step runs under ``torch.inference_mode`` (no autograd bookkeeping on any op: about 7% of
  the engine's CPU on the tiny models, against ``no_grad``); what outlives a step (the gather
  workspace, weights derived once, cached masks) is made a normal tensor, so the modules stay
  usable outside it.
"""

from __future__ import annotations

import torch

from hybridkv.engine.batch import BatchError, ForwardBatch
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.step import build_step
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import IdSpace, KindTag


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


class ModelRunner:
    def __init__(self, model: CausalLM, mem: UnifiedMemory):
        check_memory(model, mem)
        self.model = model
        self.mem = mem
        self.device = mem.device
        self.needs_state = bool(mem.slot_pools)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Last-position logits ``(R, vocab)``, one row per request of ``batch``."""
        if self.needs_state and batch.state_slots is None:
            raise BatchError("this model has recurrent layers: give every request a state slot")
        ctx = build_step(batch, self.mem, self.device, self.model.attention_sinks)
        return self.model(ctx, self.mem)
