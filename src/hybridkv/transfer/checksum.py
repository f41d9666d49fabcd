"""Integrity: a CRC32 over the bytes of a plan's ranges, in plan (destination) order.

Prefill checksums its source ranges, decode its destination ranges of the same request;
CRC32 of a concatenation does not depend on how it is cut into ranges, so a full plan and a
destination-only plan (merged differently) give the same value when the bytes landed.
"""

from __future__ import annotations

import ctypes
import zlib

from hybridkv.transfer.plan import Ops, as_ints


def crc32_ranges(addr: Ops, length: Ops) -> int:
    """CRC32 of the bytes ``[addr[i], addr[i] + length[i])`` of this process, in order."""
    crc = 0
    for a, n in zip(as_ints(addr), as_ints(length), strict=True):
        crc = zlib.crc32((ctypes.c_char * n).from_address(a), crc)
    return crc
