"""Integrity: a position-weighted checksum of byte ranges, computed with torch ops on the
tensor's own device (CPU or GPU), so it works wherever the KV lives.

Definition. The ranges are concatenated into one byte stream (zero-padded to whole 32-bit
words); word ``k`` is stream bytes ``4k .. 4k+3`` read as a little-endian unsigned int. The
checksum is ``sum_k W(k) * word_k mod 2**64`` with ``W(k) = T[k mod M] * F(k div M)``: ``T``
a fixed table of ``M`` odd pseudo-random int64 (splitmix64 of the index), ``F`` odd
pseudo-random per block of ``M`` words. Integer sums are exact and order-free, so every
device gives the same value.

Invariants:
- The value depends only on the stream, not on how it is cut into ranges: prefill sums its
  source ranges, decode its destination ranges of the same request (merged differently),
  and they agree exactly when the bytes landed.
- A single changed byte always changes the value (its weight ``W * 256**r`` times a change
  below 256 is never 0 mod 2**64: ``W`` is odd); pages that trade places change it unless
  their weights collide (pseudo-random, odds about 2**-64).
- Nothing is copied to the host but the index arrays of short or unaligned ranges and the
  final 8-byte sum (one device sync per checksum: a verification step, not a hot path).

Cost: ranges of 4-byte-aligned words (the usual case) are summed as int32 views; long ones
slice by slice, short ones gathered in batches; unaligned ranges byte by byte.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

M = 1 << 18
"""Words per weight block (1 MiB of stream)."""
LONG = 1 << 14
"""Ranges of at least this many bytes are summed slice by slice, shorter ones gathered."""
_GATHER = 1 << 20  # elements per gathered batch (bounds the index memory)
_MASK64 = (1 << 64) - 1
_WORD = 0xFFFFFFFF

_tables: dict[torch.device, torch.Tensor] = {}
_tables_lock = threading.Lock()


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 values (wrapping arithmetic)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _block_factors(first: int, count: int) -> np.ndarray:
    """``F(b)`` for blocks ``first .. first + count - 1``, as int64 (odd)."""
    blocks = np.arange(first, first + count, dtype=np.uint64) ^ np.uint64(0x5851F42D4C957F2D)
    return (_splitmix(blocks) | np.uint64(1)).view(np.int64)


def _table(device: torch.device) -> torch.Tensor:
    """``T`` on ``device`` (built once per device)."""
    with _tables_lock:
        if device not in _tables:
            words = (_splitmix(np.arange(M, dtype=np.uint64)) | np.uint64(1)).view(np.int64)
            _tables[device] = torch.from_numpy(words).to(device)
        return _tables[device]


def checksum(tensor: torch.Tensor) -> int:
    """The checksum of a tensor's bytes in row-major order (any dtype, any strides, any device)."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8)
    return checksum_ranges(data, [0], [data.numel()])


def checksum_ranges(
    buffer: torch.Tensor, offsets: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray
) -> int:
    """The checksum of ``buffer[offsets[i] : offsets[i] + lengths[i]]``, concatenated in order.

    ``buffer``: a contiguous 1-D uint8 tensor on any device; ``ValueError`` for a range
    outside it.
    """
    if buffer.dtype is not torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(
            f"checksum_ranges needs a contiguous 1-D uint8 buffer, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    offs = np.asarray(offsets, dtype=np.int64)
    lens = np.asarray(lengths, dtype=np.int64)
    if offs.shape != lens.shape:
        raise ValueError(f"{offs.size} offsets but {lens.size} lengths")
    keep = lens > 0
    offs, lens = offs[keep], lens[keep]
    if not offs.size:
        return 0
    if offs.min() < 0 or (offs + lens).max() > buffer.numel():
        i = int(np.argmax((offs < 0) | (offs + lens > buffer.numel())))
        raise ValueError(f"range [{offs[i]}, {offs[i] + lens[i]}) lies outside the {buffer.numel()} B buffer")
    pos = np.cumsum(lens) - lens  # stream position of each range
    table = _table(buffer.device)
    total = torch.zeros((), dtype=torch.int64, device=buffer.device)
    aligned = (buffer.data_ptr() % 4 == 0) & (offs % 4 == 0) & (pos % 4 == 0) & (lens % 4 == 0)
    long = aligned & (lens >= LONG)
    for o, p, n in zip(offs[long].tolist(), pos[long].tolist(), lens[long].tolist(), strict=True):
        total += _sliced(buffer, table, o, p, n)
    words = buffer.view(torch.int32) if buffer.data_ptr() % 4 == 0 and buffer.numel() % 4 == 0 else None
    short = aligned & ~long
    if short.any():
        if words is None:  # a buffer whose size is no whole number of words: read its bytes
            total += _gathered(buffer, table, offs[short], pos[short], lens[short], 1)
        else:
            total += _gathered(words, table, offs[short] // 4, pos[short], lens[short] // 4, 4)
    if not aligned.all():
        total += _gathered(buffer, table, offs[~aligned], pos[~aligned], lens[~aligned], 1)
    return int(total.item()) & _MASK64


def checksum_addresses(
    buffer: torch.Tensor, addr: Sequence[int] | np.ndarray, length: Sequence[int] | np.ndarray
) -> int:
    """``checksum_ranges`` of ranges given as addresses (a plan's ops) inside ``buffer``."""
    return checksum_ranges(buffer, np.asarray(addr, dtype=np.int64) - buffer.data_ptr(), length)


def _sliced(buffer: torch.Tensor, table: torch.Tensor, offset: int, pos: int, nbytes: int) -> torch.Tensor:
    """One word-aligned range, summed block by block over int32 views of ``buffer``."""
    out = torch.zeros((), dtype=torch.int64, device=buffer.device)
    k, end = pos // 4, (pos + nbytes) // 4
    at = offset
    while k < end:
        block, i = divmod(k, M)
        m = min(end - k, M - i)
        words = buffer[at : at + 4 * m].view(torch.int32).to(torch.int64) & _WORD
        factor = int(_block_factors(block, 1)[0])
        out += (words * table[i : i + m]).sum() * factor
        k, at = k + m, at + 4 * m
    return out


def _gathered(
    view: torch.Tensor, table: torch.Tensor, offs: np.ndarray, pos: np.ndarray, lens: np.ndarray, unit: int
) -> torch.Tensor:
    """Ranges of ``unit``-byte elements of ``view`` (offsets and lengths in elements, stream
    positions in bytes), gathered in batches of at most ``_GATHER`` elements."""
    out = torch.zeros((), dtype=torch.int64, device=view.device)
    ends = np.cumsum(lens)
    first = 0
    while first < lens.size:
        last = max(first + 1, int(np.searchsorted(ends, (ends[first - 1] if first else 0) + _GATHER, side="right")))
        o, p, n = offs[first:last], pos[first:last], lens[first:last]
        start = np.cumsum(n) - n
        step = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(start, n)
        index = np.repeat(o, n) + step
        stream = np.repeat(p, n) + unit * step  # byte position of each element
        k = stream >> 2
        blocks = k // M
        lo = int(blocks.min())
        factors = _block_factors(lo, int(blocks.max()) - lo + 1)
        weight = table[torch.from_numpy(k % M).to(view.device)] * torch.from_numpy(factors[blocks - lo]).to(view.device)
        values = view[torch.from_numpy(index).to(view.device)].to(torch.int64)
        if unit == 4:
            values &= _WORD
        else:
            values <<= torch.from_numpy(8 * (stream & 3)).to(view.device)
        out += (values * weight).sum()
        first = last
    return out
