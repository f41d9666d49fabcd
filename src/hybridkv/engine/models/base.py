"""CausalLM: the shared frame of every served model (embed -> blocks -> final norm -> logits).

A model file defines its blocks and a weight-name map; this base runs them over one
step's context and returns each request's last-position logits.

A model may be one part of a parallel layout: a pipeline stage holds the blocks of layers
``[start, end)`` (the first stage embeds, the last one norms and computes logits; the
others take and return hidden states), and a tensor-parallel rank holds its shard of
every block (``TensorParallel``; each block adds ``tp.reduce`` of its mixer's and its MLP's
partial sums to the residual).

Invariants:
- ``WEIGHT_MAP`` rewrites HF ``state_dict`` names to this module's parameter names: each
  (regex, replacement) rule applies in order; a ``None`` replacement drops a matching name
  (a weight the engine does not use). With tied embeddings ``lm_head.weight`` is dropped.
- ``FUSED`` declares the checkpoint tensors ``merge_checkpoint`` concatenates into one
  parameter (it must agree with ``merge_checkpoint``; a disagreement fails the loader's
  shape check), so a TP rank reads only its part of each of them (``checkpoint_part``).
- ``layer_rope[i]`` names the rope that layer ``i`` uses (models with one rope use "default").
- Blocks read K/V and recurrent state only through ``mem`` and the step context.
- ``layers`` is keyed by global layer id, so parameter names are the checkpoint's on every
  stage; ``local_name`` drops the names another stage or rank holds (other layers, the
  embedding off the first stage unless tied logits need it, the final norm and ``lm_head``
  off the last stage).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hybridkv.engine.forward.step import StepContext
from hybridkv.engine.layers.attention import PagedAttention
from hybridkv.engine.layers.linear import Linear, linear
from hybridkv.engine.layers.rope import RopeTables
from hybridkv.engine.tensor_parallel import SINGLE, Part, TensorParallel, collect_parts, component_part
from hybridkv.memory import UnifiedMemory


@dataclass(frozen=True)
class Fused:
    """Checkpoint tensors matching ``pattern`` (its group ``part`` names the component) that the loader
    concatenates, components in ``order`` on dim 0, into the parameter named by ``pattern``'s substitution
    ``target``; ``stacked``: one tensor per expert, stacked on a new leading dim."""

    pattern: str
    target: str
    order: tuple[str, ...]
    stacked: bool


class Block(nn.Module):
    """One decoder layer: ``forward(x, ctx, mem, rope) -> x``."""

    def forward(self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory, rope: RopeTables) -> torch.Tensor:
        raise NotImplementedError


class CausalLM(nn.Module):
    WEIGHT_MAP: ClassVar[tuple[tuple[str, str | None], ...]] = ((r"^model\.", ""),)
    FUSED: ClassVar[tuple[Fused, ...]] = ()

    def __init__(self, config: Any, layers: tuple[int, int] | None = None, tp: TensorParallel = SINGLE):
        """``layers``: this stage's ``[start, end)`` (default: every layer); ``tp``: this rank's TP shard."""
        super().__init__()
        n = int(config.num_hidden_layers)
        self.start, self.end = layers if layers is not None else (0, n)
        if not 0 <= self.start < self.end <= n:
            raise ValueError(f"stage layers [{self.start}, {self.end}) do not fit the model's {n} layers")
        self.first, self.last = self.start == 0, self.end == n
        self.tp = tp
        self.config = config
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        needs_embedding = self.first or (self.last and self.tied)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if needs_embedding else None
        self.layers = nn.ModuleDict()  # str(global layer id) -> Block
        self.ropes = nn.ModuleDict()
        self.layer_rope: list[str] = []  # per layer of this stage, in order
        own_head = self.last and not self.tied
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False) if own_head else None
        self.norm: nn.Module = nn.Identity()  # set by each model through ``final(...)``

    @property
    def layer_ids(self) -> range:
        return range(self.start, self.end)

    @functools.cached_property
    def attention_sinks(self) -> bool:
        """Some attention layer of this stage has sinks: its steps' keys need the spare zero column
        (``build_step(..., sinks=True)``); without them no step gathers it."""
        return any(isinstance(m, PagedAttention) and m.sinks is not None for m in self.modules())

    def final(self, norm: nn.Module) -> nn.Module:
        """The final norm on the last stage (nothing elsewhere)."""
        return norm if self.last else nn.Identity()

    def tp_parts(self) -> dict[str, Part]:
        """``{parameter: Part}`` of every parameter this TP rank holds only part of."""
        return collect_parts(self)

    def merge_checkpoint(self, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Checkpoint layout -> ``state_dict`` layout (e.g. fuse per-expert weights); identity by default."""
        return tensors

    def local_name(self, hf_name: str) -> str | None:
        """This model's parameter name for an HF ``state_dict`` name (``None``: not loaded here)."""
        name = hf_name
        for pattern, replacement in self.WEIGHT_MAP:
            if replacement is None:
                if re.search(pattern, name):
                    return None
            else:
                name = re.sub(pattern, replacement, name)
        if self.tied and name == "lm_head.weight":
            return None
        return name if self._on_stage(name) else None

    def checkpoint_part(self, hf_name: str, parts: Mapping[str, Part]) -> Part | None:
        """The part of checkpoint tensor ``hf_name`` this TP rank needs (``None``: all of it)."""
        for rule in self.FUSED:
            match = re.match(rule.pattern, hf_name)
            if match is not None:
                local = self.local_name(match.expand(rule.target))
                part = parts.get(local) if local is not None else None
                if part is None or part.is_zeros:
                    return part
                return component_part(part, rule.order.index(match["part"]), len(rule.order), rule.stacked)
        local = self.local_name(hf_name)
        return None if local is None else parts.get(local)

    def _on_stage(self, name: str) -> bool:
        head, _, rest = name.partition(".")
        if head == "layers":
            layer = rest.partition(".")[0]
            return layer.isdigit() and self.start <= int(layer) < self.end
        if head == "embed_tokens":
            return self.embed_tokens is not None
        if head in ("norm", "lm_head"):
            return self.last and (head == "norm" or self.lm_head is not None)
        return True

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "only the first stage embeds"
        return self.embed_tokens(ids)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(x)
        assert self.embed_tokens is not None, "tied logits need the embedding"
        return linear(x, self.embed_tokens.weight, None, self, "_packed_logits")

    def forward(self, ctx: StepContext, mem: UnifiedMemory, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Last stage: logits ``(R, vocab)`` at each request's last new token (then, for ``batch.logit_rows``, at
        every new token of those rows: ``ctx.logit_index``); other stages: hidden ``(T, hidden)``.

        ``hidden``: the previous stage's output (``None`` on the first stage, which embeds ``ctx.input_ids``).
        """
        if self.first:
            x = self.embed(ctx.input_ids)
        elif hidden is None:
            raise ValueError(f"stage [{self.start}, {self.end}) needs the previous stage's hidden states")
        else:
            x = hidden
        rope = {name: r(ctx.positions) for name, r in self.ropes.items()}
        for layer, rope_name in zip(self.layers.values(), self.layer_rope, strict=True):
            x = layer(x, ctx, mem, rope[rope_name])
        ctx.flush()  # the step's new K/V and states, into their pools once
        if not self.last:
            return x
        return self.logits(self.final_norm(x.index_select(0, ctx.logit_index)))
