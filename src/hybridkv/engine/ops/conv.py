"""Depthwise causal conv1d with a carried window (GatedDeltaNet, KDA, Mamba2 input conv).

The carried state of a request is its conv *window*: the last ``kernel - 1`` inputs it has
seen, channels first, ``[batch, channels, kernel - 1]`` (zeros for a new request). This is
the window a ``Linear`` layer keeps per request (in the spec one state tensor per component of the
concatenated input: ``conv_q``/``conv_k``/``conv_v``, ``conv_x``/``conv_B``/``conv_C``; Mamba1 ``conv_state``).
Invariants:
- prefill of a chunk with window ``w`` == the conv over ``concat(w, chunk)`` with no padding,
  i.e. transformers' ``causal_conv1d_fn`` over the whole sequence restricted to the chunk;
- the returned window holds the last ``kernel - 1`` inputs up to each request's length, so
  prefilling a sequence in chunks of any sizes gives the one-pass outputs and window;
- decode is the one-token case (transformers' ``causal_conv1d_update``);
- with ``fast_paths(fp32_conv=...)`` on, a CPU conv of bf16 / fp16 weights accumulates its taps in fp32 and rounds
  once at the end (bf16 elementwise ops on the CPU widen and round at every tap: about twice the time, four roundings).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.engine.fast_paths import FAST


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"causal conv1d: unsupported activation {activation!r}; the models here use 'silu' or None")


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the taps accumulate in: the weight's, or fp32 for a CPU half-precision weight (``fp32_conv``)."""
    if FAST.fp32_conv and weight.device.type == "cpu":
        return torch.promote_types(weight.dtype, torch.float32)
    return weight.dtype


def causal_conv1d_prefill(
    x: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv of a batch of chunks that continue the given windows.

    Args:
        x: new inputs ``[batch, seq, channels]`` (right-padded when ``lengths`` is given).
        window: each request's previous ``kernel - 1`` inputs ``[batch, channels, kernel - 1]``.
        weight: depthwise kernel ``[channels, kernel]``.
        bias: ``[channels]`` or None.
        activation: ``"silu"`` or None.
        lengths: ``[batch]`` valid tokens per row (None: all ``seq``).

    Returns:
        ``(out [batch, seq, channels], new_window [batch, channels, kernel - 1])``; outputs at
        padded positions are unspecified.
    """
    batch, seq, channels = x.shape
    kernel = weight.shape[-1]
    if window.shape != (batch, channels, kernel - 1):
        raise ValueError(
            f"causal conv1d: window shape {tuple(window.shape)} does not match inputs {tuple(x.shape)} and "
            f"kernel {kernel}: expected {(batch, channels, kernel - 1)}"
        )
    # time-major, one fused multiply-add per tap: a depthwise conv this small costs more as a conv call
    dtype = _compute_dtype(weight)
    weight = weight.to(dtype)
    full = torch.cat([window.transpose(1, 2).to(dtype), x.to(dtype)], dim=1)  # [batch, k-1+seq, ch]
    out = full[:, :seq] * weight[:, 0]
    for tap in range(1, kernel):
        out.addcmul_(full[:, tap : tap + seq], weight[:, tap])
    if bias is not None:
        out = out + bias
    out = _activate(out, activation).to(x.dtype)
    if lengths is None:
        new_window = full[:, seq:]
    else:
        # Row b's last kernel-1 inputs sit at positions lengths[b] .. lengths[b] + kernel - 2 of `full`.
        index = lengths[:, None] + torch.arange(kernel - 1, device=x.device)[None, :]
        new_window = torch.gather(full, 1, index[:, :, None].expand(batch, kernel - 1, channels))
    return out, new_window.transpose(1, 2).to(window.dtype)


def causal_conv1d_decode(
    x: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per request: ``x [batch, channels]`` -> ``(out [batch, channels], new_window)``."""
    batch, channels = x.shape
    kernel = weight.shape[-1]
    if window.shape != (batch, channels, kernel - 1):
        raise ValueError(
            f"causal conv1d decode: window shape {tuple(window.shape)} does not match inputs {tuple(x.shape)} and "
            f"kernel {kernel}: expected {(batch, channels, kernel - 1)}"
        )
    dtype = _compute_dtype(weight)
    full = torch.cat([window.to(dtype), x.unsqueeze(-1).to(dtype)], dim=-1)
    out = (full * weight.to(dtype)).sum(-1)
    if bias is not None:
        out = out + bias
    return _activate(out, activation).to(x.dtype), full[:, :, 1:].to(window.dtype)
