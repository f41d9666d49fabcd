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

import functools

import torch
import torch.nn.functional as F

from hybridkv.engine.ops.varlen import check_state, chunk_width, length_mask


@functools.lru_cache(maxsize=64)
def _tril_masks(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(above_or_on, above)``: where ``_segment_sum`` zeroes before summing and where it puts ``-inf``
    (built once per size and device: the masks never change)."""
    with torch.inference_mode(False):  # cached past the runner's inference mode: normal tensors
        strict_lower = torch.tril(torch.ones(size, size, device=device, dtype=torch.bool), diagonal=-1)
        lower = torch.tril(torch.ones(size, size, device=device, dtype=torch.bool), diagonal=0)
        return ~strict_lower, ~lower


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j+1 : i+1])`` for ``j <= i``, ``-inf`` above the diagonal."""
    size = x.size(-1)
    zeroed, above = _tril_masks(size, x.device)
    out = torch.cumsum(x[..., None].expand(*x.size(), size).masked_fill(zeroed, 0), dim=-2)
    return out.masked_fill_(above, -torch.inf)


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

    The reference's products, as batched matmuls in a ``[batch, chunk, head, position, ...]`` layout; B and C
    stay per group (a group's heads share them: ``G = C B^T`` is computed once per group, not per head).
    """
    batch, seq, heads, head_dim = x.shape
    groups, n = B.shape[2], B.shape[3]
    rep = heads // groups
    check_state(state, (batch, heads, head_dim, n), "(batch, heads, head_dim, state_size)", "SSD prefill")
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    if lengths is not None:
        dt = dt * length_mask(lengths, seq)[..., None]

    x = x.float()
    dt = dt.float()
    chunk_size = chunk_width(seq, chunk_size)
    pad = (chunk_size - seq % chunk_size) % chunk_size
    c, size = (seq + pad) // chunk_size, chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [batch, seq, k, ...] -> [batch, chunk, k, position, ...]
        if pad:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.view(batch, c, size, *t.shape[2:]).transpose(2, 3)

    xs = chunked(x * dt[..., None]).contiguous()  # [b, c, h, l, p]: two matmuls read it
    A = chunked(A.to(x.dtype) * dt)  # [b, c, h, l]
    A_cumsum = torch.cumsum(A, dim=-1)
    Bc, Cc = chunked(B.float()), chunked(C.float())  # [b, c, g, l, n]

    # Diagonal blocks: causal attention-like product inside each chunk.
    L = torch.exp(_segment_sum(A))  # [b, c, h, l, s]
    G = torch.matmul(Cc, Bc.transpose(-1, -2))  # [b, c, g, l, s]
    M = (G[:, :, :, None] * L.view(batch, c, groups, rep, size, size)).view(batch, c, heads, size, size)
    y = torch.matmul(M, xs)  # [b, c, h, l, p]

    # Each chunk's own contribution to the state at its end.
    decay_states = torch.exp(A_cumsum[..., -1:] - A_cumsum)  # [b, c, h, l]
    B_decay = (Bc[:, :, :, None] * decay_states.view(batch, c, groups, rep, size, 1)).view(batch, c, heads, size, n)
    states = torch.matmul(xs.transpose(-1, -2), B_decay)  # [b, c, h, p, n]

    # Inter-chunk recurrence, starting from the carried state: [b, h, c + 1, p, n], the carried state first.
    states = torch.cat([state[:, :, None].to(dtype=states.dtype, device=states.device), states.transpose(1, 2)], 2)
    ends = F.pad(A_cumsum[..., -1].transpose(1, 2), (1, 0))  # [b, h, c + 1]
    decay_chunk = torch.exp(_segment_sum(ends))  # [b, h, c + 1 (to), c + 1 (from)]
    new_states = torch.matmul(decay_chunk, states.view(batch, heads, c + 1, head_dim * n))
    new_states = new_states.view(batch, heads, c + 1, head_dim, n)
    final_state = new_states[:, :, -1]
    starts = new_states[:, :, :-1].transpose(1, 2)  # [b, c, h, p, n]

    # Off-diagonal blocks: each chunk's start state read out through C.
    read = torch.matmul(Cc[:, :, :, None], starts.reshape(batch, c, groups, rep, head_dim, n).transpose(-1, -2))
    y = y.addcmul_(read.view(batch, c, heads, size, head_dim), torch.exp(A_cumsum)[..., None])

    y = y.transpose(2, 3).reshape(batch, c * size, heads, head_dim)[:, :seq] + D[..., None] * x
    return y, final_state


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
    ``[batch, groups, state_size]``, state ``[batch, heads, head_dim, state_size]`` (fp32) ->
    ``(y [batch, heads, head_dim] in x's dtype, new state)``: ``state`` is updated in place (as the
    reference's ``selective_state_update`` does) and returned."""
    batch, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    check_state(state, (batch, heads, head_dim, state_size), "(batch, heads, head_dim, state_size)", "SSD decode")
    dt = F.softplus(dt + dt_bias.to(dt.dtype))[..., None, None]
    dA = torch.exp(dt.float() * A.float()[:, None, None])
    B = B[:, :, None, :].expand(batch, groups, heads // groups, state_size).reshape(batch, heads, 1, state_size)
    h = state.mul_(dA).addcmul_(dt * B, x[..., None])
    C = C[:, :, None, :].expand(batch, groups, heads // groups, state_size).reshape(batch * heads, state_size, 1)
    y = torch.bmm(h.to(C.dtype).reshape(batch * heads, head_dim, state_size), C).reshape(batch, heads, head_dim)
    y = y + x * D[:, None]
    return y.to(x.dtype), h
