"""Linear projections, with oneDNN's packed weights for bf16 on the CPU.

Every projection of the engine's layers is a ``Linear`` and the logits go through ``linear`` (the
lm_head, or the tied embedding); routed experts take their packed weights from ``expert_weights``.
On a CPU whose oneDNN computes bf16 natively (AMX-BF16 /
AVX512-BF16: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``), a bf16 input times a bf16 weight
runs through ``torch.ops.mkldnn._linear_pointwise`` with the weight reordered once into oneDNN's
blocked layout (``_reorder_linear_weight``): ``F.linear`` re-packs the weight on every call. One
thread, this machine (AMX-BF16): 1 x 512 -> 1024 74 -> 31 µs, 16 x 512 -> 1024 86 -> 42 µs,
32 x 2048 -> 512 179 -> 104 µs, 200 x 512 -> 1024 291 -> 217 µs, 512 x 512 -> 2048 1020 -> 979 µs;
bit-identical results (the same kernel family, the same fp32 accumulation). fp32 keeps ``F.linear``
(packed it is mixed: slower at one row); so does every other device or dtype, a graph being
traced (``torch.compile``), and a call that records gradients.

The packed weight is derived from the weight (``norms.derived``): made on first use, made again
after the weight changed (a load writes it in place; a conversion replaces it), one more copy of
the weight in memory.

``fast_paths(packed_linears=False)`` turns the packed path off inside a block (the benchmarks' side-by-side
baseline).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.layers.norms import derived


@functools.cache
def _onednn_bf16() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` takes the packed path."""
    return (  # per projection and step: ``is_cpu`` (~60 ns), not ``device.type`` (~300 ns, a device object made)
        FAST.packed_linears
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not torch.compiler.is_compiling()
        and _onednn_bf16()
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner: nn.Module, name: str = "_packed"
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; packed (see the module) when ``packs``, the packed weight kept on ``owner``
    under ``name``."""
    if not packs(x, weight) or (bias is not None and bias.dtype != torch.bfloat16):
        return F.linear(x, weight, bias)
    packed = derived(owner, name, (weight,), torch.ops.mkldnn._reorder_linear_weight)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` whose bf16 CPU forward uses the packed weight (``linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self)


def expert_weights(x: torch.Tensor, weight: torch.Tensor, owner: nn.Module, name: str) -> list[torch.Tensor] | None:
    """Routed experts' weights ``(E, out, in)`` (a view of any layout), each expert's packed for ``x`` (kept on
    ``owner`` under ``name``, made again after the weights changed), or None when ``x`` does not take the packed
    path (``Routing.matmul`` then runs ``grouped_mm``, whose CPU form is one unpacked ``mm`` per expert: widened
    Qwen3-Next decodes, ~8 rows x 512 -> 512 each, ~110 µs a call)."""
    if weight.dim() != 3 or not packs(x, weight[0]):
        return None
    return derived(
        owner, name, (weight,), lambda w: [torch.ops.mkldnn._reorder_linear_weight(e.contiguous()) for e in w.unbind(0)]
    )
