"""Mamba2 state-space duality (SSD) scan (Nemotron-H): chunked prefill and one-step decode.

The recurrent state of a request is ``h [heads, head_dim, state_size]`` (fp32). Per token,
with ``dt = softplus(dt_raw + dt_bias)`` and B, C shared by the heads of a group:
``h = exp(dt * A) h + dt * x ⊗ B;  y = h C + D x``.
Invariants:
- the arithmetic mirrors transformers 5.23.0's ``mamba2_chunk_scan`` (prefill, where ``dt``
  is clamped to ``dt_limit``) and ``mamba2_selective_state_update`` (decode, where it is not:
  the reference's decode path never applies the limit, so neither does this one);
- ``lengths`` right-pads a batch of unequal chunks: the discretised ``dt`` is zero at padded
  positions (decay 1, no input), so each row's final state is its own;
- splitting a sequence at any boundaries and carrying the state equals one pass within fp32
  rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.engine.ops.varlen import check_state, length_mask


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j+1 : i+1])`` for ``j <= i``, ``-inf`` above the diagonal."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    strict_lower = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~strict_lower, 0)
    out = torch.cumsum(x, dim=-2)
    lower = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=0)
    return out.masked_fill(~lower, -torch.inf)


def _chunks(x: torch.Tensor, pad: int, chunk_size: int) -> torch.Tensor:
    """``[batch, seq, ...]`` -> ``[batch, chunks, chunk_size, ...]`` with zero padding at the end."""
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])


def ssd_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan over a batch of chunks that continue ``state``.

    Args:
        x: ``[batch, seq, heads, head_dim]``; dt: raw time steps ``[batch, seq, heads]``.
        A: ``[heads]`` (negative, i.e. ``-exp(A_log)``); D, dt_bias: ``[heads]``.
        B, C: ``[batch, seq, groups, state_size]``.
        state: ``[batch, heads, head_dim, state_size]`` (zeros for a new request).
        chunk_size: the model's SSD chunk size (``config.chunk_size``).
        dt_limit: clamp of the discretised ``dt`` (transformers: ``(time_step_min, inf)``).
        lengths: ``[batch]`` valid tokens per row (None: all ``seq``).

    Returns:
        ``(y [batch, seq, heads, head_dim] fp32, final state [batch, heads, head_dim, state_size] fp32)``.
    """
    batch, seq, heads, head_dim = x.shape
    groups = B.shape[2]
    check_state(state, (batch, heads, head_dim, B.shape[-1]), "(batch, heads, head_dim, state_size)", "SSD prefill")
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    if lengths is not None:
        dt = dt * length_mask(lengths, seq)[..., None]

    x = x.float()
    B = B.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    C = C.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    pad = (chunk_size - seq % chunk_size) % chunk_size
    d_residual = D[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad))

    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()
    x, A, B, C = (_chunks(t, pad, chunk_size) for t in (x, A, B, C))

    A = A.permute(0, 3, 1, 2)
    A_cumsum = torch.cumsum(A, dim=-1)

    # Diagonal blocks: causal attention-like product inside each chunk.
    L = torch.exp(_segment_sum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)

    # Each chunk's own contribution to the state at its end.
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)

    # Inter-chunk recurrence, starting from the carried state.
    states = torch.cat([state[:, None].to(dtype=states.dtype, device=states.device), states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]

    # Off-diagonal blocks: each chunk's start state read out through C.
    state_decay_out = torch.exp(A_cumsum)
    c_times_states = torch.einsum("bclhn,bchpn->bclhp", C, states)
    y_off = c_times_states * state_decay_out.permute(0, 2, 3, 1)[..., None]

    y = (y_diag + y_off).contiguous().reshape(batch, -1, heads, head_dim) + d_residual
    return y[:, :seq], final_state


def ssd_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: x ``[batch, heads, head_dim]``, dt ``[batch, heads]``, B, C
    ``[batch, groups, state_size]``, state ``[batch, heads, head_dim, state_size]`` ->
    ``(y [batch, heads, head_dim] in x's dtype, new state in state's dtype)``."""
    batch, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    check_state(state, (batch, heads, head_dim, state_size), "(batch, heads, head_dim, state_size)", "SSD decode")
    dt = F.softplus(dt + dt_bias.to(dt.dtype))[..., None, None]
    dA = torch.exp(dt.float() * A.float()[:, None, None])
    B = B[:, :, None, :].expand(batch, groups, heads // groups, state_size).reshape(batch, heads, 1, state_size)
    h = state * dA + dt * B * x[..., None]
    C = C[:, :, None, :].expand(batch, groups, heads // groups, state_size).reshape(batch * heads, state_size, 1)
    y = torch.bmm(h.to(C.dtype).reshape(batch * heads, head_dim, state_size), C).reshape(batch, heads, head_dim)
    y = y + x * D[:, None]
    return y.to(x.dtype), h.to(state.dtype)
