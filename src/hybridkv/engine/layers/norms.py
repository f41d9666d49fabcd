"""RMS norms: plain (``w * x``), offset (``(1 + w) * x``, Gemma / Qwen3-Next) and gated (GDN/KDA output).

All normalise in fp32 and cast back to the input dtype, as the reference implementations do,
through torch's fused ``rms_norm``. An offset norm's scale ``1 + w`` is derived from the
weight once and again only after the weight changed (``derived``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.ops.cast import cast, f32


def derived(
    owner: nn.Module, name: str, sources: tuple[torch.Tensor, ...], make: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """``make(*sources)``, kept on ``owner`` under ``name`` until a source changes (a load writes it in place:
    its version moves; a conversion replaces it: its storage moves)."""
    key = tuple((s._version, s.data_ptr()) for s in sources)
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        # kept past the step: a normal tensor, even when made inside the runner's inference mode
        with torch.no_grad(), torch.inference_mode(False):
            cached = owner.__dict__[name] = (key, make(*sources))
    return cached[1]


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
            return derived(self, "_scale", (self.weight,), lambda w: 1.0 + w.float())
        return f32(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale()
        if x.dtype == torch.float32:  # the common case: no casts to dispatch
            return F.rms_norm(x, self.shape, scale, self.eps)
        return F.rms_norm(x.float(), self.shape, scale, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``norm(x) * w * silu(gate)`` over the last dim (norm before gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = self.weight * cast(F.rms_norm(f32(x), self.shape, None, self.eps), x.dtype)
        return cast(h * F.silu(f32(gate)), x.dtype)
