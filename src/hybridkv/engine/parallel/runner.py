"""ShardRunner: one process's part of a parallel layout: its model shard, its memory, its step.

``ShardRunner(config, weights, Parallel(tp_size=T, pp_size=P), pp_rank, tp_rank, groups)``
builds the rank's ``ShardSpec``, its ``UnifiedMemory`` (only its stage's layers, its heads
and state shards), and the model shard (stage layers ``[start, end)``, TP rank ``tp_rank``),
reading only its part of the weights; ``forward(batch)`` runs one step.

Invariants:
- Every rank of a layout runs the same schedule with its own ``RequestAllocator`` over its
  own memory (virtual ids differ per rank; token counts do not). ``forward`` returns the
  same logits on every rank (the last stage's TP rank 0 broadcasts them); ``run_stage``
  returns this stage's own output without the broadcast (hidden states on earlier stages).
- Hidden states cross stages as ``(T, hidden)`` in the model dtype; the receiver knows
  ``T`` from its own batch. Anything else a stage needs (positions, RoPE, Gemma 3's
  embedding scale, which only the first stage applies) comes from the batch itself.
- The memory's views have exactly the shapes the shard's layers read and write
  (``check_memory``, at construction): a wrong split fails before any step runs.
- Steps run under ``torch.inference_mode``, as ``ModelRunner``'s do.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridkv.engine.batch import BatchError, ForwardBatch
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.parallel.groups import StageGroups
from hybridkv.engine.registry import engine_spec, text_config
from hybridkv.engine.runner import check_memory
from hybridkv.engine.step import build_step
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel
from hybridkv.engine.weights import build_model, read_config, read_safetensors
from hybridkv.memory import UnifiedMemory, parse_bytes
from hybridkv.memory.host import check_fits
from hybridkv.spec import ModelSpec, Parallel, ShardSpec

Weights = Mapping[str, torch.Tensor] | str | Path


class ShardRunner:
    def __init__(
        self,
        config: Any,
        weights: Weights,
        parallel: Parallel | None = None,
        pp_rank: int = 0,
        tp_rank: int = 0,
        groups: StageGroups | None = None,
        *,
        gpu_memory: int | str = "256MiB",
        page_size: int = 16,
        chunk_size: int = 64,
        max_context: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        spec: ModelSpec | None = None,
        mem: UnifiedMemory | None = None,
    ):
        """``config``: a ``transformers`` config or a directory with ``config.json``; ``weights``: HF-named
        tensors or a ``*.safetensors`` directory (read partially: only this shard's part). ``groups``: the
        layout's process groups (needed when the layout has more than one process). ``mem``: a memory
        built by the caller for exactly this rank's shard (e.g. in shared memory a transfer writes into);
        by default one of ``gpu_memory`` bytes is built here."""
        parallel = parallel or Parallel()
        if isinstance(config, str | Path):
            config = read_config(config)
        self.config = text_config(config)
        if parallel.pp_size * parallel.tp_size > 1:
            if groups is None:
                raise ValueError(f"a layout of PP {parallel.pp_size} x TP {parallel.tp_size} needs its StageGroups")
            if (groups.parallel, groups.pp_rank, groups.tp_rank) != (parallel, pp_rank, tp_rank):
                raise ValueError(
                    f"groups are for {groups.parallel} pp {groups.pp_rank} tp {groups.tp_rank}, "
                    f"the runner for {parallel} pp {pp_rank} tp {tp_rank}: build both from one layout"
                )
        self.groups = groups
        self.spec = spec or engine_spec(self.config, dtype)
        self.shard = ShardSpec(self.spec, parallel, pp_rank, tp_rank)
        if mem is not None and mem.shard != self.shard:
            raise ValueError(
                f"the memory given is for {mem.shard.describe()}, this runner is {self.shard.describe()}: "
                "build the memory from the runner's ShardSpec"
            )
        if mem is None:  # a budget the host cannot hold: a user error, before allocating
            check_fits(parse_bytes(gpu_memory), device, f"the memory of {self.shard.describe()}", "lower gpu_memory")
        self.mem = mem or UnifiedMemory.create(
            self.shard,
            parse_bytes(gpu_memory),
            device,
            page_size=page_size,
            max_context=max_context or self.spec.max_context,
            chunk_tokens=chunk_size,
        )
        self.device = self.mem.device
        tp = (
            TensorParallel(parallel.tp_size, tp_rank, groups.all_reduce)
            if parallel.tp_size > 1 and groups is not None
            else SINGLE
        )
        source = (lambda model: read_safetensors(weights, model)) if isinstance(weights, str | Path) else weights
        self.model: CausalLM = build_model(self.config, source, dtype, self.device, self.shard.bounds, tp)
        self.dtype = dtype
        check_memory(self.model, self.mem)

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
            raise BatchError(f"{self.shard.describe()} has recurrent layers: give every request a state slot")
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
