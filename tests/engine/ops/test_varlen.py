"""Ragged <-> padded layout helpers."""

from __future__ import annotations

import torch

from hybridkv.engine.ops import length_mask
from hybridkv.engine.ops.varlen import chunk_width

from .chunking import pad_ragged, unpad_ragged


def test_pad_then_unpad_is_identity_and_padding_is_zero() -> None:
    lengths = torch.tensor([3, 0, 1, 4])
    starts = torch.cumsum(lengths, 0) - lengths
    flat = torch.arange(1, 9, dtype=torch.float32)[:, None].expand(8, 2).contiguous()
    padded = pad_ragged(flat, starts, lengths, 4)
    assert padded.shape == (4, 4, 2)
    assert padded[:, :, 0].tolist() == [[1, 2, 3, 0], [0, 0, 0, 0], [4, 0, 0, 0], [5, 6, 7, 8]]
    assert torch.equal(unpad_ragged(padded, lengths, 8), flat)
    assert length_mask(lengths, 4).sum(dim=1).tolist() == [3, 0, 1, 4]


def test_chunk_width_is_the_chunk_or_the_smallest_power_of_two_holding_a_shorter_call() -> None:
    for chunk in (8, 16, 32, 48, 64, 100):  # a model's SSD chunk need not be a power of two
        for seq in range(1, 3 * chunk):
            width = chunk_width(seq, chunk)
            if seq >= chunk:
                assert width == chunk
            else:
                assert seq <= width <= chunk and (width == chunk or (width & (width - 1) == 0 and width < 2 * seq))
    assert chunk_width(40, 48) == 48 and chunk_width(20, 48) == 32
