"""Fixtures of the tier tests: store clients against the session's ``mooncake_master``
(``tests/conftest.py``; tests that kill a master start their own), unique key prefixes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from hybridkv.tiers import MooncakeMaster, MooncakeStoreTier


@pytest.fixture
def mooncake_store(mooncake_master: MooncakeMaster) -> Iterator[MooncakeStoreTier]:
    store = MooncakeStoreTier(mooncake_master.address, segment_bytes=32 << 20)
    yield store
    store.close()


@pytest.fixture
def unique() -> str:
    """A key prefix no other test uses (tests share the session's store)."""
    return f"test/{uuid.uuid4().hex[:12]}/"
