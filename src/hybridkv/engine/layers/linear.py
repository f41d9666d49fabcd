"""Linear projections, with oneDNN's packed weights for bf16 on the CPU, and for fp32 where that pays.

Every projection of the engine's layers is a ``Linear`` and the logits go through ``linear`` (the
lm_head, or the tied embedding); routed experts take their packed weights from ``expert_weights``.
On a CPU whose oneDNN computes bf16 natively (AMX-BF16 /
AVX512-BF16: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``), a bf16 input times a bf16 weight
runs through ``torch.ops.mkldnn._linear_pointwise`` with the weight reordered once into oneDNN's
blocked layout (``_reorder_linear_weight``): ``F.linear`` re-packs the weight on every call. One
thread, an AMX Xeon (AMX-BF16): 1 x 512 -> 1024 74 -> 31 µs, 16 x 512 -> 1024 86 -> 42 µs,
32 x 2048 -> 512 179 -> 104 µs, 200 x 512 -> 1024 291 -> 217 µs, 512 x 512 -> 2048 1020 -> 979 µs;
bit-identical results (the same kernel family, the same fp32 accumulation).

fp32 (``fast_paths(packed_fp32=...)``) takes the same packed path only where it measured faster than ``F.linear``,
whose fp32 GEMM is MKL's sgemm; where that is depends on the CPU (``fp32_packing``: one rule per kind, picked once by
the CPU's vendor):
- **Intel** (``MKL_FULL_WIDTH``): MKL runs its widest kernels, so packing pays only in a middle band: 4 to 128 rows
  and at least 2**22 multiply-adds (oneDNN's fixed cost per call, ~30 µs, loses at 1 or 2 rows and on small calls:
  8 x 512 -> 512 55 -> 83 µs; sgemm catches up from ~128 rows but on the logits, and wins from ~1024; widened Gemma 3
  dense's 144-token prefill step, one thread, median of 15 alternating: 78 -> 89 ms packed). One thread, an AMX
  Xeon, best of 5 alternating, F.linear -> packed: 4 x 512 -> 2048 355 -> 255 µs, 16 x 2048 -> 512 597 -> 424 µs,
  64 x 512 -> 2048 1165 -> 1050 µs, 64 x 512 -> 32000 (logits) 23.8 -> 19.8 ms, 256 x 512 -> 32000 74 -> 62 ms;
  1 x 512 -> 2048 202 -> 246 µs, 1024 x 2048 -> 512 14.8 -> 15.3 ms (hence the bounds).
- **any other x86 CPU** (``MKL_NARROW``): MKL dispatches its AVX2 code there, at half the rate oneDNN reaches with
  AVX-512, so packing pays at every row count from 2**20 multiply-adds. One thread, an AMD EPYC (Zen 5), best of 5
  alternating, weights cycled out of cache, F.linear -> packed: 1024 x 512 -> 2048 18.2 -> 7.9 ms (120 -> 272
  GFLOP/s), 256 x 512 -> 32000 78 -> 32 ms, 64 x 512 -> 32000 21.8 -> 8.7 ms, 16 x 512 -> 512 89 -> 44 µs,
  5 x 512 -> 256 25 -> 16 µs, 64 x 128 -> 256 38 -> 25 µs, 128 x 64 -> 128 20 -> 17 µs; below 2**20: 64 x 64 -> 128
  11 -> 12 µs, 16 x 64 -> 128 4 -> 11 µs.
The fp32 weight is packed for 64 rows (``_reorder_linear_weight``'s batch hint: any hint from 4 rows on measured alike,
none 15% slower on the logits). Not bit-equal to ``F.linear`` (another summation order): within fp32 rounding.

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

from hybridkv.engine.cpuinfo import cpu_field
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


@dataclass(frozen=True)
class Fp32Packing:
    """Where an fp32 call takes the packed path: ``x`` of ``least_rows`` to ``most_rows`` rows (both included; None: no
    bound) and at least ``least_macs`` multiply-adds (rows x in x out)."""

    least_rows: int
    most_rows: int | None
    least_macs: int

    def takes(self, rows: int, macs: int) -> bool:
        within = self.most_rows is None or rows <= self.most_rows
        return self.least_rows <= rows and within and macs >= self.least_macs


MKL_FULL_WIDTH = Fp32Packing(least_rows=4, most_rows=128, least_macs=1 << 22)
"""An Intel CPU, where MKL's sgemm runs its widest kernels (the module's measurements)."""
MKL_NARROW = Fp32Packing(least_rows=1, most_rows=None, least_macs=1 << 20)
"""Any other x86 CPU, where MKL's sgemm runs its AVX2 code (the module's measurements)."""


def packing_for(vendor: str | None) -> Fp32Packing:
    """The fp32 rule for a CPU of ``vendor`` (``/proc/cpuinfo``'s ``vendor_id``): Intel's where the vendor is Intel or
    unknown (the narrower band: packing where it loses costs more than missing it where it wins), else the narrow
    sgemm's."""
    return MKL_FULL_WIDTH if vendor in (None, "GenuineIntel") else MKL_NARROW


@functools.cache
def fp32_packing() -> Fp32Packing:
    """This machine's fp32 rule (``packing_for`` its vendor)."""
    return packing_for(cpu_field("vendor_id"))


FP32_HINT = 64
"""The rows the fp32 weights are packed for (oneDNN picks the blocked layout by them; any other count still runs)."""


def packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` is packed: bf16 always, fp32 where it pays (``fp32_packing``)."""
    if torch.compiler.is_compiling():  # first: a traced graph keeps F.linear, and dynamo warns of the cached probes
        return False
    if x.dtype == torch.bfloat16:
        if not (FAST.packed_linears and weight.dtype == torch.bfloat16 and _onednn_bf16()):
            return False
    elif x.dtype == torch.float32:
        if not (FAST.packed_fp32 and weight.dtype == torch.float32 and weight.dim() == 2 and _onednn()):
            return False
        rows = x.numel() // max(1, x.shape[-1])
        if not fp32_packing().takes(rows, rows * weight.shape[0] * weight.shape[1]):
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
