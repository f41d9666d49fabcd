"""Linear projections, with oneDNN's packed weights for bf16 on the CPU, and for fp32 where that pays.

Every projection of the engine's layers is a ``Linear`` and the logits go through ``linear`` (the
lm_head, or the tied embedding); routed experts take their packed weights from ``expert_weights``.
On a CPU whose oneDNN computes bf16 natively (AMX-BF16 /
AVX512-BF16: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``), a bf16 input times a bf16 weight
runs through ``torch.ops.mkldnn._linear_pointwise`` with the weight reordered once into oneDNN's
blocked layout (``_reorder_linear_weight``): ``F.linear`` re-packs the weight on every call. One
thread, this machine (AMX-BF16): 1 x 512 -> 1024 74 -> 31 µs, 16 x 512 -> 1024 86 -> 42 µs,
32 x 2048 -> 512 179 -> 104 µs, 200 x 512 -> 1024 291 -> 217 µs, 512 x 512 -> 2048 1020 -> 979 µs;
bit-identical results (the same kernel family, the same fp32 accumulation).

fp32 (``fast_paths(packed_fp32=...)``) takes the same packed path only where it measured faster than ``F.linear``
(MKL's sgemm): ``FP32_ROWS`` rows (oneDNN's fixed cost per call, ~30 µs, loses at 1 or 2 rows; sgemm catches up from
~128 rows but on the logits, and wins from ~1024; in the engine, widened Gemma 3 dense's 144-token prefill step, one
thread, median of 15 alternating: 78 -> 89 ms packed) and at least ``FP32_MACS`` multiply-adds (below, the call's cost
dominates: 8 x 512 -> 512 55 -> 83 µs). One thread, this machine, best of 5 alternating, F.linear -> packed: 4 x 512
-> 2048 355 -> 255 µs, 16 x 2048 -> 512 597 -> 424 µs, 64 x 512 -> 2048 1165 -> 1050 µs, 64 x 512 -> 32000 (logits)
23.8 -> 19.8 ms, 256 x 512 -> 32000 74 -> 62 ms; 1 x 512 -> 2048 202 -> 246 µs, 1024 x 2048 -> 512 14.8 -> 15.3 ms
(hence the bounds). Two threads (this shared 2-core machine: ~7 ms stalls swamp many cells), where measurable, the
same picture: packed 0.5-0.9x from 16 rows to 256, 1.3-5x at 1 to 8 rows of the small shapes. The fp32 weight is
packed for 64 rows (``_reorder_linear_weight``'s batch hint: any hint from 4 rows on measured alike, none 15% slower
on the logits). Not bit-equal to ``F.linear`` (another summation order): within fp32 rounding.

A decode's few rows (one or two bf16, up to four fp32) take neither: ``ops.skinny_linear`` streams the plain weight
(``fast_paths(skinny_linears=...)``).

Every other device or dtype keeps ``F.linear``, as do a graph being traced (``torch.compile``) and a call that
records gradients; routed experts pack bf16 only.

The packed weight is derived from the weight (``norms.derived``): made on first use, made again
after the weight changed (a load writes it in place; a conversion replaces it), one more copy of
the weight in memory (for fp32, as large as the model's weights).

``fast_paths(packed_linears=False)`` turns the bf16 packed path off inside a block, ``packed_fp32=False`` the fp32 one
(the benchmarks' side-by-side baseline).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.layers.norms import derived
from hybridkv.engine.ops.skinny_linear import skinny_linear, skinny_takes


@functools.cache
def _onednn_bf16() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _onednn() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except RuntimeError:
        return False


FP32_ROWS = (4, 128)
"""The rows (tokens) of an fp32 ``x`` that take the packed path: from the first to the second, both included."""
FP32_MACS = 1 << 22
"""The least multiply-adds (rows x in x out) of an fp32 call on the packed path."""
FP32_HINT = 64
"""The rows the fp32 weights are packed for (oneDNN picks the blocked layout by them; any other count still runs)."""


def packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` is packed: bf16 always, fp32 where it pays (``FP32_ROWS``, ``FP32_MACS``)."""
    if torch.compiler.is_compiling():  # first: a traced graph keeps F.linear, and dynamo warns of the cached probes
        return False
    if x.dtype == torch.bfloat16:
        if not (FAST.packed_linears and weight.dtype == torch.bfloat16 and _onednn_bf16()):
            return False
    elif x.dtype == torch.float32:
        if not (FAST.packed_fp32 and weight.dtype == torch.float32 and weight.dim() == 2 and _onednn()):
            return False
        rows = x.numel() // max(1, x.shape[-1])
        if not (FP32_ROWS[0] <= rows <= FP32_ROWS[1] and rows * weight.shape[0] * weight.shape[1] >= FP32_MACS):
            return False
    else:
        return False
    return (  # per projection and step: ``is_cpu`` (~60 ns), not ``device.type`` (~300 ns, a device object made)
        x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def _pack(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float32:
        return torch.ops.mkldnn._reorder_linear_weight(weight, FP32_HINT)
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner: nn.Module, name: str = "_packed"
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: the skinny kernel for a few rows (``ops.skinny_linear``), else packed (see the
    module) when ``packs``, the packed weight kept on ``owner`` under ``name``."""
    if skinny_takes(x, weight, bias):
        return skinny_linear(x, weight, bias)
    if not packs(x, weight) or (bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    packed = derived(owner, name, (weight,), _pack)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU forward uses the packed weight where ``packs`` (``linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self)


@dataclass(frozen=True)
class PackedExperts:
    """Routed experts' weights for ``x @ w.T``: ``plain`` ``(E, out, in)`` (a view of any layout) and ``packed``, each
    expert's weight packed for oneDNN."""

    plain: torch.Tensor
    packed: list[torch.Tensor]

    def times(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """``x @ plain[expert].T``: the skinny kernel for a few rows of a plain weight whose rows are contiguous,
        else the packed weight."""
        if skinny_takes(x, self.plain[expert]):
            return skinny_linear(x, self.plain[expert])
        return torch.ops.mkldnn._linear_pointwise(x, self.packed[expert], None, "none", [], "")


def expert_weights(x: torch.Tensor, weight: torch.Tensor, owner: nn.Module, name: str) -> PackedExperts | None:
    """Routed experts' weights ``(E, out, in)`` (a view of any layout), each expert's packed for ``x`` (kept on
    ``owner`` under ``name``, made again after the weights changed), or None when ``x`` is not bf16 (fp32 experts:
    not measured) or does not take the packed path (``Routing.matmul`` then runs ``grouped_mm``, whose CPU form is one
    unpacked ``mm`` per expert: widened Qwen3-Next decodes, ~8 rows x 512 -> 512 each, ~110 µs a call)."""
    if weight.dim() != 3 or x.dtype != torch.bfloat16 or not packs(x, weight[0]):
        return None
    packed = derived(
        owner, name, (weight,), lambda w: [torch.ops.mkldnn._reorder_linear_weight(e.contiguous()) for e in w.unbind(0)]
    )
    return PackedExperts(weight, packed)
