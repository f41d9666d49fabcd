"""ModelRunner: runs one ForwardBatch through a model over UnifiedMemory.

Invariants:
- Ids are translated once per step, inside ``forward``, after the caller made every
  allocation of the step; no physical id outlives the step (compaction may move cells
  between steps).
- A request's state slot is read at its ``prefix_lens`` and holds the state after its last
  new token when ``forward`` returns (zeroed first when ``fresh_state``).
"""

from __future__ import annotations

import torch

from hybridkv.engine.batch import BatchError, ForwardBatch
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.step import build_step
from hybridkv.memory import UnifiedMemory


class ModelRunner:
    def __init__(self, model: CausalLM, mem: UnifiedMemory):
        self.model = model
        self.mem = mem
        self.device = mem.device
        self.needs_state = bool(mem.slot_pools)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Last-position logits ``(R, vocab)``, one row per request of ``batch``."""
        if self.needs_state and batch.state_slots is None:
            raise BatchError("this model has recurrent layers: give every request a state slot")
        ctx = build_step(batch, self.mem, self.device)
        return self.model(ctx, self.mem)
