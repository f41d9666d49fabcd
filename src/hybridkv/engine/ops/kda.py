"""Kimi delta attention (KDA): the gated delta rule with a per-channel decay.

The recurrent state of a request is ``S [heads, dk, dv]`` (fp32). Per token, with ``q, k``
L2-normalised and ``q`` scaled by ``dk ** -0.5``:
``S = diag(exp(g)) S;  S += k ⊗ beta * (v - kᵀS);  o = qᵀS`` where ``g [dk]`` is per key channel.
Invariants:
- the arithmetic mirrors transformers 5.23.0's ``chunk_kimi_delta_attention`` (prefill; its row-by-row
  forward-substitution inverse is one triangular solve here) and ``recurrent_kimi_delta_attention``
  (decode);
- ``lengths`` right-pads a batch of unequal chunks: padded positions get ``beta = 0`` and
  ``g = 0``, which leaves the state untouched;
- splitting a sequence at any boundaries and carrying the state equals one pass within fp32
  rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.engine.ops.delta_step import delta_step
from hybridkv.engine.ops.varlen import check_state, chunk_width, length_mask


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # transformers' Kimi l2norm: sqrt and divide (unlike Qwen3-Next's rsqrt and multiply).
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lengths: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over a batch of chunks that continue ``state``.

    Args:
        q, k: ``[batch, seq, heads, dk]``; v: ``[batch, seq, heads, dv]``.
        g: per-channel log decay ``[batch, seq, heads, dk]`` (<= 0); beta: ``[batch, seq, heads]``.
        state: ``[batch, heads, dk, dv]`` (zeros for a new request).
        lengths: ``[batch]`` valid tokens per row (None: all ``seq``).

    Returns:
        ``(out [batch, seq, heads, dv] in q's dtype, final state [batch, heads, dk, dv] fp32)``.
    """
    out_dtype = q.dtype
    batch, seq, heads, dk = k.shape
    dv = v.shape[-1]
    check_state(state, (batch, heads, dk, dv), "(batch, heads, dk, dv)", "KDA prefill")
    if lengths is not None:
        valid = length_mask(lengths, seq)
        g = g * valid[..., None, None]
        beta = beta * valid[..., None]
    q, k, v, beta, g = (x.transpose(1, 2).contiguous().to(torch.float32) for x in (q, k, v, beta, g))
    q = _l2norm(q)
    k = _l2norm(k)
    scale = 1 / (dk**0.5)

    chunk_size = chunk_width(seq, chunk_size)
    pad = (chunk_size - seq % chunk_size) % chunk_size
    if pad:  # a call of whole chunks (most: chunk_width makes a short one its own chunk) is not copied
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    q = q * scale
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, v, g, k_beta, v_beta = (
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (q, k, v, g, k_beta, v_beta)
    )
    num_chunks = g.shape[2]

    g = g.cumsum(dim=-2)
    upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device), diagonal=1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp().float()
    # The reference inverts (I + L), L the strictly lower k_beta . k decay products, by forward substitution one
    # row at a time; one unit-triangular solve does the same (up to summation order) for both right-hand sides.
    lower = (k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1)
    rhs = torch.cat([v_beta, k_beta * g.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    v, k_cumdecay = torch.split(solved, [dv, dk], dim=-1)

    s = state.to(v)
    out = torch.zeros_like(v)
    for i in range(num_chunks):
        q_i, k_i, v_i, g_i = q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i]
        inter = (q_i * g_i.exp()) @ s
        intra = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay[:, :, i]).sum(dim=-1).masked_fill(upper, 0)
        v_new = v_i - k_cumdecay[:, :, i] @ s
        out[:, :, i] = inter + intra @ v_new
        s = s * g_i[:, :, -1].exp().unsqueeze(-1) + (k_i * (g_i[:, :, -1:] - g_i).exp()).transpose(-1, -2) @ v_new

    out = out.reshape(batch, heads, -1, dv)[:, :, :seq]
    return out.transpose(1, 2).contiguous().to(out_dtype), s


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: q, k ``[batch, heads, dk]``, v ``[batch, heads, dv]``, g ``[batch, heads, dk]``,
    beta ``[batch, heads]``, state ``[batch, heads, dk, dv]`` -> ``(out [batch, heads, dv], new state)``.
    ``in_place`` (an fp32 state): the new state is written into ``state`` and returned."""
    out_dtype = q.dtype
    batch, heads, dk = k.shape
    dv = v.shape[-1]
    check_state(state, (batch, heads, dk, dv), "(batch, heads, dk, dv)", "KDA decode")
    q, k, v, g, beta = (x.to(torch.float32) for x in (q, k, v, g, beta))
    q = _l2norm(q)
    k = _l2norm(k)
    q = q * (1 / (dk**0.5))

    in_place = in_place and state.dtype == torch.float32
    decay = g.exp()[..., None]
    s = state.mul_(decay) if in_place else state.to(v) * decay
    out, s = delta_step(s, q, k, v, beta, in_place)
    return out.to(out_dtype), s
