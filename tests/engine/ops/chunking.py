"""Helpers shared by the ops tests: chunk boundaries and a max-abs-diff assertion."""

from __future__ import annotations

import torch

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
