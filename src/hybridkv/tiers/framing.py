"""Stored objects: a fixed header (key digest, payload size, checksum) and the payload bytes.

Layout of a frame (little-endian)::

    magic "HKVO" | version u16 | 0 u16 | blake2b-16 of the key | payload size u64 | crc32 u32 | pad to 64
    payload bytes

``check`` returns the payload only when every field agrees with what the reader asked
for: the frame is ``HEADER + expected`` bytes, the magic and version match, the reserved
field and the padding are zero, the digest is
the key's (an object stored under another key is refused), the size field is the expected
payload size and the CRC-32 of the payload is the header's (every single-byte change, and
every burst of up to 32 bits, changes it). Anything else is a ``MissReason``, never bytes.

A *meta* frame (a ``device="meta"`` tensor) has a size and no bytes: replays move sizes
only, so ``check`` can verify only its size.

Invariant: ``check(key, n, frame(key, payload)) is payload bytes`` for every key and
payload; a frame with any single byte changed fails ``check``.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import zlib
from enum import StrEnum

import numpy as np
import torch

MAGIC = b"HKVO"
FORMAT = 1
_HEAD = struct.Struct("<4sHH16sQI")
HEADER = 64
"""Header bytes before the payload (the struct, zero-padded: payloads stay 64-byte aligned)."""


class MissReason(StrEnum):
    """Why an object a tier was asked for is not returned."""

    ABSENT = "absent"
    """The tier does not hold it (never stored, or evicted by this process's own policy)."""
    EVICTED = "evicted"
    """The tier said it held it when the load was planned, but not when it was read (a store
    evicting on its own)."""
    SIZE = "size"
    """The object's size disagrees with the expected payload (or its header's size field)."""
    CHECKSUM = "checksum"
    """The payload's CRC-32 disagrees with the header's."""
    HEADER = "header"
    """Not a frame of this format, or a frame stored under another key."""
    DOWN = "down"
    """The tier is down (its service unreachable); nothing was read."""
    TIMEOUT = "timeout"
    """The tier did not answer in time (it is marked down)."""
    ERROR = "error"
    """The tier answered with an error code of its own."""


@functools.lru_cache(maxsize=64)
def meta_frame(nbytes: int) -> torch.Tensor:
    """A frame of ``nbytes`` with no bytes (a replay's): one shared meta tensor per size, which
    nothing ever writes."""
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def write_header(frame: torch.Tensor, key: str) -> torch.Tensor:
    """Write the header of ``frame`` (``HEADER`` + payload bytes, payload already in place);
    returns ``frame``."""
    if frame.device.type == "meta":
        return frame
    payload = frame[HEADER:].numpy()
    head = _HEAD.pack(MAGIC, FORMAT, 0, key_digest(key), payload.size, zlib.crc32(payload.data))
    frame[: len(head)].numpy()[:] = np.frombuffer(head, dtype=np.uint8)
    frame[len(head) : HEADER].zero_()
    return frame


def frame(key: str, payload: torch.Tensor) -> torch.Tensor:
    """A new frame holding a copy of ``payload`` (1-D uint8) under ``key``."""
    out = torch.empty(HEADER + payload.numel(), dtype=torch.uint8, device=payload.device)
    if payload.device.type != "meta":
        out[HEADER:].copy_(payload)
    return write_header(out, key)


def check(key: str, expected: int, blob: torch.Tensor) -> torch.Tensor | MissReason:
    """The payload of ``blob`` (a view) if it is ``key``'s frame of ``expected`` payload bytes."""
    if blob.numel() != HEADER + expected:
        return MissReason.SIZE
    if blob.device.type == "meta":
        return blob[HEADER:]
    head = blob[:HEADER].numpy().tobytes()
    magic, version, reserved, digest, size, crc = _HEAD.unpack(head[: _HEAD.size])
    if magic != MAGIC or version != FORMAT or reserved or digest != key_digest(key) or head[_HEAD.size :].strip(b"\0"):
        return MissReason.HEADER
    if size != expected:
        return MissReason.SIZE
    payload = blob[HEADER:]
    if zlib.crc32(payload.numpy().data) != crc:
        return MissReason.CHECKSUM
    return payload
