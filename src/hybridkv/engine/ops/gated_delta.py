"""Gated delta rule (Qwen3-Next GatedDeltaNet): chunked prefill and one-step decode.

The recurrent state of a request is ``S [heads_v, dk, dv]`` (fp32). Per token, with
``q, k`` L2-normalised and ``q`` scaled by ``dk ** -0.5``:
``S = exp(g) * S;  S += k ⊗ beta * (v - kᵀS);  o = qᵀS``.
Invariants:
- the arithmetic mirrors transformers 5.23.0's ``torch_chunk_gated_delta_rule`` (prefill; its
  row-by-row inversion of the intra-chunk system is one unit-triangular solve here, for both
  right-hand sides at once) and ``torch_recurrent_gated_delta_rule`` (decode) operation for
  operation, so one pass is equal to the reference up to summation order;
- ``lengths`` right-pads a batch of unequal chunks: padded positions get ``beta = 0`` and
  ``g = 0``, which leaves the state untouched, so each row's final state is its own;
- chunks are counted from each call's first token, so splitting a sequence at any boundaries
  and carrying the state equals one pass within fp32 rounding;
- with ``fast_paths(flush_decays=...)`` on, a decay factor ``exp(x)`` of the prefill with ``x < -FLUSH`` is exactly
  zero, and so is a decayed key of the intra-chunk solve below ``e**(-2 * FLUSH)``: no denormal floats (ten times
  slower to multiply on the CPU) come out of a steeply decaying head, and the terms dropped (below ``e**-FLUSH`` of a
  state read or a key) are under fp32's rounding of each output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.delta_step import delta_step
from hybridkv.engine.ops.varlen import check_state, chunk_width, length_mask

FLUSH = 30.0
"""Log decays below ``-FLUSH`` are flushed to a zero factor (``fast_paths(flush_decays=...)``): ``e**-30`` ~ 1e-13
keeps the product of two factors (~1e-26) and of a factor and any value the ops meet well above fp32's smallest
normal (~1.2e-38)."""


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """``exp(log_decay)``, the factors below ``e**-FLUSH`` exactly zero when ``flush_decays`` is on."""
    if FAST.flush_decays:
        log_decay = log_decay.masked_fill(log_decay < -FLUSH, float("-inf"))
    return log_decay.exp()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # transformers' Qwen3-Next l2norm (FLA convention: eps inside the rsqrt).
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gated_delta_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lengths: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over a batch of chunks that continue ``state``.

    Args:
        q, k: ``[batch, seq, heads_k, dk]``; v: ``[batch, seq, heads_v, dv]`` (``heads_v`` a
            multiple of ``heads_k``: each q/k head serves consecutive value heads).
        g: log decay ``[batch, seq, heads_v]`` (<= 0); beta: ``[batch, seq, heads_v]``.
        state: ``[batch, heads_v, dk, dv]``, the state before the chunk (zeros for a new request).
        lengths: ``[batch]`` valid tokens per row (None: all ``seq``).

    Returns:
        ``(out [batch, seq, heads_v, dv] in q's dtype, final state [batch, heads_v, dk, dv] fp32)``.
    """
    out_dtype = q.dtype
    batch, seq, heads_k, dk = k.shape
    heads_v, dv = v.shape[-2:]
    check_state(state, (batch, heads_v, dk, dv), "(batch, heads_v, dk, dv)", "gated delta prefill")
    if lengths is not None:
        valid = length_mask(lengths, seq)
        g = g * valid[..., None]
        beta = beta * valid[..., None]
    if heads_k != heads_v:
        q = q.repeat_interleave(heads_v // heads_k, dim=2)
        k = k.repeat_interleave(heads_v // heads_k, dim=2)
    q, k, v, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, beta, g)
    )
    q = _l2norm(q)
    k = _l2norm(k)
    q = q * q.shape[-1] ** -0.5

    chunk_size = chunk_width(seq, chunk_size)
    pad = (chunk_size - seq % chunk_size) % chunk_size
    if pad:  # a call of whole chunks (most: chunk_width makes a short one its own chunk) is not copied
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk_size)
    num_chunks = g.shape[2]

    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pair_decay = _decay((cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")))
    ut = (k_beta @ k.transpose(-1, -2)) * pair_decay
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    decay = _decay(cum).unsqueeze(-1)
    # one unit-triangular solve for both right-hand sides: the values and the decayed keys
    rhs = torch.cat((v_beta, k_beta * decay), dim=-1)
    solved = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]
    if FAST.flush_decays:  # the solve multiplies factors along chains: its decayed keys can still come out denormal
        k_cumdecay = k_cumdecay.masked_fill(k_cumdecay.abs() < math.exp(-2 * FLUSH), 0.0)

    s = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * decay
    k = k * _decay(cum[..., -1:] - cum).unsqueeze(-1)
    chunk_decay = _decay(cum[..., -1])[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new

    out = out.reshape(batch, heads_v, -1, dv)[:, :, :seq]
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), s


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: q, k ``[batch, heads_k, dk]``, v ``[batch, heads_v, dv]``, g, beta
    ``[batch, heads_v]``, state ``[batch, heads_v, dk, dv]`` -> ``(out [batch, heads_v, dv], new state)``.
    ``in_place`` (an fp32 state): the new state is written into ``state`` and returned (the same arithmetic, no
    state-sized temporaries: on the widened Qwen3-Next decodes each would be megabytes a layer)."""
    out_dtype = q.dtype
    batch, heads_k, dk = k.shape
    heads_v, dv = v.shape[-2:]
    check_state(state, (batch, heads_v, dk, dv), "(batch, heads_v, dk, dv)", "gated delta decode")
    if heads_k != heads_v:
        q = q.repeat_interleave(heads_v // heads_k, dim=1)
        k = k.repeat_interleave(heads_v // heads_k, dim=1)
    q, k, v, beta, g = (x.to(torch.float32) for x in (q, k, v, beta, g))
    q = _l2norm(q)
    k = _l2norm(k)
    q = q / (q.shape[-1] ** 0.5)

    in_place = in_place and state.dtype == torch.float32
    decay = g.exp()[..., None, None]
    s = state.mul_(decay) if in_place else state.to(v) * decay
    out, s = delta_step(s, q, k, v, beta, in_place)
    return out.to(out_dtype), s
