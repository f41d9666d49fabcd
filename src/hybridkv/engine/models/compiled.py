"""An optional compiled path: ``torch.compile`` of each block's dense body (norms, projections, dense MLPs).

``compile_blocks(model)`` compiles every decoder block's ``forward`` with dynamic shapes (the
step's token count changes every step) and leaves each mixer that reads the memory (attention,
MLA, GatedDeltaNet, Mamba2, KDA: any module with ``memory_shapes``) eager: dynamo breaks the
graph around it, so the step's pool I/O and its data-dependent group loop never enter a
compiled graph; routed experts stay eager as well (``ROUTED``).

Off by default: measured with ``hybridkv bench engine --compile`` on the tiny models (one CPU
thread) it does not pay here (Gemma 3: 0.46 s of CPU for the workload against 0.42 s eager,
after a 15 s first pass that compiles); the first steps of each new shape pay the compilation.

Invariants: the compiled blocks compute exactly what the eager ones do (inductor may reorder
float sums: the exactness tests' tolerance, not bit equality); compiling twice is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.engine.layers.grouped_moe import RoutedExperts
from hybridkv.engine.layers.mlp import GptOssMoE, SoftmaxTopKMoE
from hybridkv.engine.models.base import CausalLM

# Routed experts run ``grouped_mm``, which dynamo cannot trace in fp32 (its fake kernel wants bf16): eager too.
ROUTED = (SoftmaxTopKMoE, GptOssMoE, RoutedExperts)


def compile_blocks(model: CausalLM, backend: str = "inductor") -> CausalLM:
    """Compile ``model``'s blocks in place (memory-reading mixers stay eager); returns ``model``.

    ``backend``: torch.compile's (``"eager"`` traces and runs the captured graphs without generating code: a
    quick check of what dynamo captures)."""
    if getattr(model, "compiled_blocks", False):
        raise ValueError("the model's blocks are compiled already")
    import torch._dynamo

    # every block is its own compiled function, each step shape a guard set: room for both
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for block in model.layers.values():
        for module in block.modules():
            if module is not block and (callable(getattr(module, "memory_shapes", None)) or isinstance(module, ROUTED)):
                _eager(module)
        block.forward = torch.compile(block.forward, dynamic=True, backend=backend)
    model.compiled_blocks = True  # type: ignore[assignment]
    return model


def _eager(module: nn.Module) -> None:
    module.forward = torch._dynamo.disable(module.forward)
