"""Casts that cost nothing when there is nothing to cast.

A ``Tensor.to`` / ``.float()`` to the dtype a tensor already has returns it unchanged but still
goes through torch's dispatcher (microseconds each, on every layer of every step); these check
the dtype in Python first.
"""

from __future__ import annotations

import torch


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()
