"""CausalLM: the shared frame of every served model (embed -> blocks -> final norm -> logits).

A model file defines its blocks and a weight-name map; this base runs them over one
step's context and returns each request's last-position logits.

Invariants:
- ``WEIGHT_MAP`` rewrites HF ``state_dict`` names to this module's parameter names: each
  (regex, replacement) rule applies in order; a ``None`` replacement drops a matching name
  (a weight the engine does not use). With tied embeddings ``lm_head.weight`` is dropped.
- ``layer_rope[i]`` names the rope that layer ``i`` uses (models with one rope use "default").
- Blocks read K/V and recurrent state only through ``mem`` and the step context.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from hybridkv.engine.step import StepContext
from hybridkv.memory import UnifiedMemory


class WeightError(ValueError):
    """Weights that do not fit the model: missing, unexpected or wrongly shaped."""


_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint per-expert MLPs -> fused ``experts.gate_up_proj`` ``(E, 2I, H)``, ``experts.down_proj`` ``(E, H, I)``.

    Published checkpoints (and ``save_pretrained``) store ``<p>.experts.<e>.{gate,up,down}_proj.weight``;
    ``transformers`` fuses them at load, as this does. Every expert 0..E-1 needs all three.
    """
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            groups.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = tensor
    for prefix, experts in groups.items():
        lacking = [
            f"{prefix}.experts.{e}.{part}.weight"
            for e in range(max(experts) + 1)
            for part in ("gate_proj", "up_proj", "down_proj")
            if part not in experts.get(e, {})
        ]
        if lacking:
            raise WeightError(f"missing expert weights {', '.join(lacking[:6])}")
        ordered = [experts[e] for e in range(len(experts))]
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([x["gate_proj"], x["up_proj"]]) for x in ordered]
        )
        out[f"{prefix}.experts.down_proj"] = torch.stack([x["down_proj"] for x in ordered])
    return out


class Block(nn.Module):
    """One decoder layer: ``forward(x, ctx, mem, cos, sin) -> x``."""

    def forward(
        self, x: torch.Tensor, ctx: StepContext, mem: UnifiedMemory, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError


class CausalLM(nn.Module):
    WEIGHT_MAP: ClassVar[tuple[tuple[str, str | None], ...]] = ((r"^model\.", ""),)

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.vocab_size = int(config.vocab_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList()
        self.ropes = nn.ModuleDict()
        self.layer_rope: list[str] = []
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.norm: nn.Module = nn.Identity()  # set by each model

    def merge_checkpoint(self, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Checkpoint layout -> ``state_dict`` layout (e.g. fuse per-expert weights); identity by default."""
        return tensors

    def local_name(self, hf_name: str) -> str | None:
        """This model's parameter name for an HF ``state_dict`` name (``None``: not loaded)."""
        name = hf_name
        for pattern, replacement in self.WEIGHT_MAP:
            if replacement is None:
                if re.search(pattern, name):
                    return None
            else:
                name = re.sub(pattern, replacement, name)
        return None if self.tied and name == "lm_head.weight" else name

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return x @ weight.t()

    def forward(self, ctx: StepContext, mem: UnifiedMemory) -> torch.Tensor:
        """Logits ``(R, vocab)`` at each request's last new token."""
        x = self.embed(ctx.input_ids)
        rope = {name: r(ctx.positions) for name, r in self.ropes.items()}
        for layer, rope_name in zip(self.layers, self.layer_rope, strict=True):
            cos, sin = rope[rope_name]
            x = layer(x, ctx, mem, cos, sin)
        return self.logits(self.final_norm(x[ctx.last_index]))
