"""Gated delta rule (Qwen3-Next GatedDeltaNet): chunked prefill and one-step decode.

The recurrent state of a request is ``S [heads_v, dk, dv]`` (fp32). Per token, with
``q, k`` L2-normalised and ``q`` scaled by ``dk ** -0.5``:
``S = exp(g) * S;  S += k ⊗ beta * (v - kᵀS);  o = qᵀS``.
Invariants:
- the arithmetic mirrors transformers 5.23.0's ``torch_chunk_gated_delta_rule`` (prefill; its
  row-by-row inversion of the intra-chunk system is one unit-triangular solve here; its loop
  over chunks carries the state alone, every chunk's output then read from the state before it
  in one batched product) and ``torch_recurrent_gated_delta_rule`` (decode) operation for
  operation, so one pass is equal to the reference up to summation order;
- ``lengths`` right-pads a batch of unequal chunks: padded positions get ``beta = 0`` and
  ``g = 0``, which leaves the state untouched, so each row's final state is its own;
- chunks are counted from each call's first token, so splitting a sequence at any boundaries
  and carrying the state equals one pass within fp32 rounding;
- bf16 inputs on a CPU that multiplies bf16 (AMX or AVX-512 BF16) take ``ops.delta_chunks``
  (``fast_paths(delta_chunks=...)``): the same rule in one C++ call, its products' operands rounded to bf16 (within
  bf16's rounding of this path);
- with ``fast_paths(flush_decays=...)`` on, a decay factor ``exp(x)`` of the prefill with ``x < -FLUSH`` is exactly
  zero, and so is an entry of the intra-chunk inverse below ``e**-FLUSH``: no denormal floats (ten times
  slower to multiply on the CPU) come out of a steeply decaying head, and the terms dropped (below ``e**-FLUSH`` of a
  state read or a key) are under fp32's rounding of each output.
"""

from __future__ import annotations

import math

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.delta_chunks import delta_chunks, delta_chunks_take
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


def _heads_first(x: torch.Tensor, padded: int) -> torch.Tensor:
    """``[batch, seq, heads, ...]`` -> ``[batch, heads, padded, ...]`` fp32, zeros past ``seq`` (one copy)."""
    out = x.new_zeros((x.shape[0], x.shape[2], padded, *x.shape[3:]), dtype=torch.float32)
    out[:, :, : x.shape[1]].copy_(x.transpose(1, 2))
    return out


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
    if delta_chunks_take(q, k, v, g, beta, state):
        return delta_chunks(q, k, v, g, beta, state, lengths, FLUSH if FAST.flush_decays else math.inf)
    if lengths is not None:
        valid = length_mask(lengths, seq)
        g = g * valid[..., None]
        beta = beta * valid[..., None]
    chunk_size = chunk_width(seq, chunk_size)
    padded = -(-seq // chunk_size) * chunk_size
    q, k, v, beta, g = (_heads_first(x, padded) for x in (q, k, v, beta, g))
    q = _l2norm(q)
    k = _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    if heads_k != heads_v:  # normalised per key head, then each serves its value heads
        q = q.repeat_interleave(heads_v // heads_k, dim=1)
        k = k.repeat_interleave(heads_v // heads_k, dim=1)
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)

    # every (row, head, chunk) one matrix of a batch: [rows * heads * chunks, chunk, dim]
    rows, chunks = batch * heads_v, padded // chunk_size
    q, k, k_beta, v_beta = (x.view(rows * chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.view(rows * chunks, chunk_size).cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = _decay((cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(upper, float("-inf")))
    ut = torch.bmm(k_beta, k.transpose(1, 2)).mul_(pair_decay)
    intra = torch.bmm(q, k.transpose(1, 2)).mul_(pair_decay)
    # the reference's inverse of the intra-chunk system (one unit-triangular solve), then both its products
    eye = torch.eye(chunk_size, dtype=ut.dtype, device=ut.device).expand_as(ut)
    inverse = torch.linalg.solve_triangular(ut, eye, upper=False, unitriangular=True)
    if FAST.flush_decays:  # it multiplies decays along chains: its entries can still come out denormal
        inverse = inverse.masked_fill(inverse.abs() < math.exp(-FLUSH), 0.0)
    decay = _decay(cum).unsqueeze(-1)
    new_values = torch.bmm(inverse, v_beta).view(rows, chunks, chunk_size, dv)
    k_cumdecay = torch.bmm(inverse, k_beta.mul_(decay)).view(rows, chunks, chunk_size, dk)
    q = q.mul_(decay)
    k = k.mul_(_decay(cum[:, -1:] - cum).unsqueeze(-1)).view(rows, chunks, chunk_size, dk).transpose(-1, -2)
    chunk_decay = _decay(cum[:, -1]).view(rows, chunks, 1, 1)

    # the recurrence over chunks carries the state alone (each chunk's state before it kept); the outputs, which
    # only read those states, are then one batched product for every chunk at once
    states = torch.empty(rows, chunks, dk, dv, dtype=torch.float32, device=q.device)
    states[:, 0] = state.reshape(rows, dk, dv)
    final = torch.empty(rows, dk, dv, dtype=torch.float32, device=q.device)
    v_new = torch.empty(rows, chunks, chunk_size, dv, dtype=torch.float32, device=q.device)
    for i in range(chunks):
        torch.baddbmm(new_values[:, i], k_cumdecay[:, i], states[:, i], alpha=-1, out=v_new[:, i])
        after = states[:, i + 1] if i + 1 < chunks else final
        torch.mul(states[:, i], chunk_decay[:, i], out=after).baddbmm_(k[:, i], v_new[:, i])
    out = torch.bmm(q, states.view(rows * chunks, dk, dv)).baddbmm_(intra, v_new.view(rows * chunks, chunk_size, dv))
    out = out.view(batch, heads_v, padded, dv)[:, :, :seq]
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), final.view(batch, heads_v, dk, dv)


def decode_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode's inputs as its state update reads them: fp32, q and k per value head (``[batch, heads_v, dk]``),
    L2-normalised, q scaled by ``dk ** -0.5``; ``(q, k, v, g, beta)``."""
    heads_k, heads_v = k.shape[1], v.shape[1]
    if heads_k != heads_v:
        q = q.repeat_interleave(heads_v // heads_k, dim=1)
        k = k.repeat_interleave(heads_v // heads_k, dim=1)
    q, k, v, g, beta = (x.to(torch.float32) for x in (q, k, v, g, beta))
    q = _l2norm(q)
    k = _l2norm(k)
    return q / (q.shape[-1] ** 0.5), k, v, g, beta


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
    batch, dk = k.shape[0], k.shape[-1]
    heads_v, dv = v.shape[-2:]
    check_state(state, (batch, heads_v, dk, dv), "(batch, heads_v, dk, dv)", "gated delta decode")
    q, k, v, g, beta = decode_inputs(q, k, v, g, beta)
    in_place = in_place and state.dtype == torch.float32
    decay = g.exp()[..., None, None]
    s = state.mul_(decay) if in_place else state.to(v) * decay
    out, s = delta_step(s, q, k, v, beta, in_place)
    return out.to(out_dtype), s
