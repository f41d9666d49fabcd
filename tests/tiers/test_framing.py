"""Frames: a payload comes back only under its own key, at its own size, with its checksum."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.tiers.framing import HEADER, MissReason, check, frame


def _payload(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_round_trip_is_the_payload():
    p = _payload(1000)
    got = check("a/key", 1000, frame("a/key", p))
    assert isinstance(got, torch.Tensor) and torch.equal(got, p)


@given(st.integers(0, HEADER + 299), st.integers(1, 255))
def test_every_single_byte_change_is_refused(pos, flip):
    """A changed byte anywhere, header or payload, is never returned as data."""
    f = frame("k", _payload(300, 1))
    f[pos] ^= flip
    got = check("k", 300, f)
    assert isinstance(got, MissReason)
    if pos >= HEADER:
        assert got is MissReason.CHECKSUM
    else:
        assert got in (MissReason.HEADER, MissReason.SIZE, MissReason.CHECKSUM)


def test_another_key_size_or_a_truncation_is_a_miss():
    f = frame("k1", _payload(64))
    assert check("k2", 64, f) is MissReason.HEADER
    assert check("k1", 63, f) is MissReason.SIZE
    assert check("k1", 64, f[:-1]) is MissReason.SIZE
    longer = frame("k1", _payload(65))
    assert check("k1", 64, longer[:-1]) is MissReason.SIZE  # the size field says 65


def test_meta_frames_carry_only_a_size():
    f = frame("k", torch.empty(100, dtype=torch.uint8, device="meta"))
    assert f.device.type == "meta" and f.numel() == HEADER + 100
    got = check("k", 100, f)
    assert isinstance(got, torch.Tensor) and got.numel() == 100
    assert check("k", 99, f) is MissReason.SIZE
