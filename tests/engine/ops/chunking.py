"""Helpers shared by the ops tests: chunk boundaries, ragged <-> padded batches, a max-abs-diff assertion.

Padding positions are zero: the recurrent ops mask their gates there, so a padded tail never changes a
request's carried state (what the ragged-batch tests check).
"""

from __future__ import annotations

import torch

from hybridkv.engine.ops import length_mask

# Chunk sizes cycled to split a sequence: single tokens, odd sizes, exactly one kernel chunk, more.
SPLIT_SIZES = (1, 5, 7, 64, 3, 70)


def spans(total: int, sizes: tuple[int, ...] = SPLIT_SIZES) -> list[tuple[int, int]]:
    """Consecutive ``(start, end)`` spans covering ``range(total)``, sized by cycling ``sizes``."""
    out: list[tuple[int, int]] = []
    start = 0
    i = 0
    while start < total:
        end = min(total, start + sizes[i % len(sizes)])
        out.append((start, end))
        start = end
        i += 1
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> float:
    """Assert ``max |actual - expected| <= atol`` (shapes equal, all finite); return the max diff."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    diff = (actual.double() - expected.double()).abs().max().item()
    assert diff <= atol, f"{what}: max abs diff {diff:.3e} > atol {atol:.0e}"
    return diff


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
