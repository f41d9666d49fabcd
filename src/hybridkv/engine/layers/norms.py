"""RMS norms: plain (``w * x``), offset (``(1 + w) * x``, Gemma / Qwen3-Next) and gated (GDN/KDA output).

All normalise in fp32 and cast back to the input dtype, as the reference implementations do,
through torch's fused ``rms_norm``. An offset norm's scale ``1 + w`` is derived from the
weight once and again only after the weight changed (``derived``).

A bf16 (or fp16) input on the CPU takes ``rms_norm_rounded`` (``fast_paths.rms_norms``): torch's CPU
``rms_norm`` is a composite that makes a fresh fp32 tensor at each of its steps (the copy, pow, two
multiplies, the cast); this one makes the fp32 copy and the squares, then scales the copy in place: the
same ops in the same order, so the same bits, with two fewer tensors of the input's size in fp32 (each
one's page faults cost about what its arithmetic does; 2048 x 512: ~3.8 -> ~3.1 ms; 2048 x 6 x 128, the
q/k norms: ~6.7 -> ~4.4 ms; 200 x 512: 78 -> 66 µs). A form with one reduction (``vector_norm``, about 4x
cheaper at 2048 rows) did not go in: its mean square differs in the last fp32 bit, enough to move a few
outputs in a million one bf16 step, and greedy tokens of the tiny random models then drift apart.

Ahead of both, ``fast_paths.fused_norms`` (a bf16 or fp32 CPU input, the C++ kernels built): ``ops.rms_norm``'s one
pass per row, the residual add after the norm (``RMSNorm(x, residual=...)``) fused in; its numbers and bounds are
that module's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.cast import cast, f32
from hybridkv.engine.ops.rms_norm import fuses_gated_norm, fuses_norm, gated_rms_norm_fused, rms_norm_fused

T = TypeVar("T")


def derived(owner: nn.Module, name: str, sources: tuple[torch.Tensor, ...], make: Callable[..., T]) -> T:
    """``make(*sources)``, kept on ``owner`` under ``name`` until a source changes (a load writes it in place:
    its version moves; a conversion replaces it: its storage moves)."""
    if len(sources) == 1:  # the common case (a weight), without a generator: called per projection and norm, per step
        key: tuple[int, ...] = (sources[0]._version, sources[0].data_ptr())
    else:
        key = tuple(v for s in sources for v in (s._version, s.data_ptr()))
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        # kept past the step: a normal tensor, even when made inside the runner's inference mode
        with torch.no_grad(), torch.inference_mode(False):
            cached = owner.__dict__[name] = (key, make(*sources))
    return cached[1]


def rounds_norm(x: torch.Tensor) -> bool:
    """Whether ``x`` takes ``rms_norm_rounded``: a reduced-precision CPU tensor, the fast path on."""
    return FAST.rms_norms and x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu"


def rms_norm_rounded(
    x: torch.Tensor, scale: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``(x / rms(x)) * scale`` over the last dim, in fp32, rounded once to ``x``'s dtype (``x`` reduced precision:
    its fp32 copy is the work buffer); ``scale`` fp32, broadcast over the trailing dims. torch's composite's ops in
    its order (``rsqrt(mean(x^2) + eps)``, times ``x``, times the scale). ``residual``: ``residual + that``, added in
    ``x``'s dtype. A bf16 ``x`` takes the fused kernel where ``ops.rms_norm.fuses_norm`` holds."""
    if fuses_norm(x, scale, residual):
        assert scale is not None
        return rms_norm_fused(x, scale, eps, residual)
    work = x.float()
    inv = work.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    work.mul_(inv)
    if scale is not None:
        work.mul_(scale)
    out = work.to(x.dtype)
    return out if residual is None else residual + out


def _one_plus(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.shape = (dim,)

    def scale(self) -> torch.Tensor:
        """The fp32 factor after normalising: ``w`` or ``1 + w``."""
        if self.offset:
            return derived(self, "_scale", (self.weight,), _one_plus)
        return f32(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of ``x``; with ``residual``, ``residual + norm(x)`` (the add in ``x``'s dtype: one fused pass
        where ``ops.rms_norm.fuses_norm`` holds)."""
        scale = self.scale()
        if fuses_norm(x, scale, residual):
            return rms_norm_fused(x, scale, self.eps, residual)
        if rounds_norm(x):
            return rms_norm_rounded(x, scale, self.eps, residual)
        if x.dtype == torch.float32:  # the common case: no casts to dispatch
            out = F.rms_norm(x, self.shape, scale, self.eps)
        else:
            out = F.rms_norm(x.float(), self.shape, scale, self.eps).to(x.dtype)
        return out if residual is None else residual + out


class GatedRMSNorm(nn.Module):
    """``norm(x) * w * silu(gate)`` over the last dim (norm before gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``gate``: ``x``'s entries in its order (any view whose rows are contiguous: a projection's slice)."""
        if fuses_gated_norm(x, self.weight, gate):
            return gated_rms_norm_fused(x, self.weight, gate, self.eps)
        h = self.weight * cast(F.rms_norm(f32(x), self.shape, None, self.eps), x.dtype)
        return cast(h * F.silu(f32(gate.reshape(x.shape))), x.dtype)
