"""The device checksum: exact against a plain reference, independent of how the stream is
cut, equal on strided views and their ranges, and it catches a flipped byte and swapped pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.transfer import checksum as cs
from hybridkv.transfer.checksum import checksum, checksum_ranges


def reference(data: bytes) -> int:
    """The definition, byte by byte in Python."""
    total = 0
    for p, b in enumerate(data):
        k = p >> 2
        weight = int(cs._table(torch.device("cpu"))[k % cs.M]) * int(cs._block_factors(k // cs.M, 1)[0])
        total += weight * (b << (8 * (p & 3)))
    return total & ((1 << 64) - 1)


def cuts(n: int, rng: np.random.Generator, pieces: int) -> list[int]:
    return [0, *sorted(rng.choice(np.arange(1, n), size=pieces, replace=False).tolist()), n]


def test_matches_the_definition_and_ignores_how_the_stream_is_cut():
    rng = np.random.default_rng(0)
    data = torch.from_numpy(rng.integers(0, 256, 3000, dtype=np.uint8))
    want = reference(bytes(data.numpy()))
    assert checksum(data) == want
    for pieces in (1, 7, 200):  # unaligned cuts: the byte path; aligned ones: the word path
        edges = cuts(data.numel(), rng, pieces)
        assert checksum_ranges(data, edges[:-1], np.diff(edges)) == want
    aligned = [0, 400, 1200, 3000]
    assert checksum_ranges(data, aligned[:-1], np.diff(aligned)) == want


def test_long_ranges_across_weight_blocks_agree_with_gathered_pieces():
    """A 3 MiB stream spans weight blocks: one long slice == many short and unaligned ranges,
    and ranges read in stream order from scattered places of a buffer."""
    rng = np.random.default_rng(1)
    n = 3 << 20
    data = torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
    whole = checksum(data)
    edges = cuts(n, rng, 3000)
    assert checksum_ranges(data, edges[:-1], np.diff(edges)) == whole
    # the same stream stored as 4 KiB pages in shuffled order, read back page by page
    order = rng.permutation(n // 4096)
    pages = data.view(-1, 4096)[torch.from_numpy(order)].reshape(-1)
    offs = np.argsort(order) * 4096
    assert checksum_ranges(pages, offs, np.full(offs.size, 4096)) == whole


def test_strided_views_equal_their_ranges():
    arena = torch.from_numpy(np.random.default_rng(2).integers(0, 256, 1 << 16, dtype=np.uint8))
    cells = arena[4096:].view(-1, 8, 4, 64)  # (cell, page slot, head, bytes)
    view = cells[3:9, :, 1:3]  # two heads of six cells: not contiguous
    assert not view.is_contiguous()
    rows = [4096 + ((3 + c) * 8 + s) * 256 + 64 for c in range(6) for s in range(8)]  # heads 1, 2: 128 B
    assert checksum(view) == checksum_ranges(arena, rows, [128] * len(rows)) == checksum(view.contiguous())
    halves = cells[3:9, :, 1:3].to(torch.float16)  # a wider dtype: its bytes, in row-major order
    assert checksum(halves) == checksum(halves.contiguous().view(torch.uint8))


def test_detects_a_flipped_byte_and_swapped_pages():
    rng = np.random.default_rng(3)
    pages = torch.from_numpy(rng.integers(0, 256, (64, 512), dtype=np.uint8))
    good = checksum(pages)
    for at in (0, 1, 2, 3, 777, pages.numel() - 1):
        bad = pages.clone().view(-1)
        bad[at] ^= 1 << int(rng.integers(8))
        assert checksum(bad) != good, at
    swapped = pages.clone()
    swapped[[5, 40]] = pages[[40, 5]]
    assert checksum(swapped) != good
    # pages with the same bytes in another order (equal byte sums) still differ once swapped
    same_sum = pages.clone()
    same_sum[9] = pages[8].flip(0)
    moved = same_sum.clone()
    moved[[8, 9]] = same_sum[[9, 8]]
    assert checksum(moved) != checksum(same_sum)


def test_refuses_ranges_outside_the_buffer():
    buf = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"range \[96, 104\) lies outside the 100 B buffer"):
        checksum_ranges(buf, [0, 96], [4, 8])
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        checksum_ranges(buf.view(10, 10), [0], [4])
    assert checksum_ranges(buf, [], []) == 0 == checksum(buf)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_give_the_host_value():
    rng = np.random.default_rng(4)
    host = torch.from_numpy(rng.integers(0, 256, (3 << 20) + 5, dtype=np.uint8))
    edges = cuts(host.numel(), rng, 500)
    device = host.cuda()
    assert checksum(device) == checksum(host)
    assert checksum_ranges(device, edges[:-1], np.diff(edges)) == checksum(host)
    view = device[: 3 << 20].view(-1, 4, 256)[:, 1:3]
    assert checksum(view) == checksum(view.cpu())
