"""Ragged <-> padded layout for a batch of requests' new tokens.

The engine lays the new tokens of a step out flat (request after request); the chunked
recurrent ops run on a right-padded ``[batch, max_len, ...]`` batch with a ``lengths``
vector. Invariants:
- ``lengths`` and ``starts`` live on the tokens' device; nothing here reads them on the host
  (``max_len`` is a Python int the caller already knows from building the batch).
- Padding positions are zero: the recurrent ops mask their gates there, so a padded tail
  never changes a request's carried state.
"""

from __future__ import annotations

import torch


def check_state(state: torch.Tensor, expected: tuple[int, ...], dims: str, what: str) -> None:
    """Refuse a carried state whose shape is not what the inputs imply (both shapes named;
    ``dims`` names the expected dimensions, e.g. ``"(batch, heads, dk, dv)"``)."""
    if tuple(state.shape) != expected:
        raise ValueError(
            f"{what}: state shape {tuple(state.shape)} does not match the inputs: expected {dims} = {expected}"
        )


def length_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[batch, max_len]`` bool: True where position ``t < lengths[b]``."""
    positions = torch.arange(max_len, device=lengths.device)
    return positions[None, :] < lengths[:, None]


def pad_ragged(flat: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Flat ``[tokens, ...]`` -> right-padded ``[batch, max_len, ...]`` (zeros past each length).

    Request ``b`` owns ``flat[starts[b] : starts[b] + lengths[b]]``.
    """
    mask = length_mask(lengths, max_len)
    index = (starts[:, None] + torch.arange(max_len, device=flat.device)[None, :]).clamp_(max=flat.shape[0] - 1)
    padded = flat[index]
    keep = mask.reshape(*mask.shape, *([1] * (flat.dim() - 1)))
    return torch.where(keep, padded, torch.zeros((), dtype=flat.dtype, device=flat.device))


def unpad_ragged(padded: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Right-padded ``[batch, max_len, ...]`` -> flat ``[total, ...]`` (``total == lengths.sum()``)."""
    padding = ~length_mask(lengths, padded.shape[1])
    # A stable sort puts the valid positions first, in request order, without a host-side nonzero.
    order = torch.sort(padding.reshape(-1).to(torch.uint8), stable=True).indices[:total]
    return padded.reshape(-1, *padded.shape[2:])[order]
