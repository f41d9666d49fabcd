"""Shape checks and length masks for the recurrent ops' right-padded batches.

The chunked recurrent ops run on a right-padded ``[batch, max_len, ...]`` batch with a
``lengths`` vector (the engine pads with ``StepContext`` groups). Invariants:
- ``lengths`` lives on the tokens' device; nothing here reads it on the host (``max_len`` is a
  Python int the caller already knows from building the batch).
- A carried state whose shape disagrees with the inputs is refused, both shapes named.
- ``chunk_width`` changes a scan's result only within rounding: a call shorter than its chunk is one chunk either
  way, and padded positions leave the state and the valid outputs untouched.
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


def chunk_width(seq: int, chunk_size: int) -> int:
    """The chunk a chunked scan uses for a call whose rows are ``seq`` positions wide: ``chunk_size``, or, when the
    call is shorter, the smallest power of two that holds it (at most ``chunk_size``). Such a call is one chunk at
    either width, so only the padding is saved (a step of short prefill chunks padded to a whole scan chunk computed
    up to its width again); powers of two keep the shapes few."""
    if seq >= chunk_size:
        return chunk_size
    return min(chunk_size, 1 << max(seq - 1, 0).bit_length())
