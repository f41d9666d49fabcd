"""Shared test fixtures: hypothesis profiles, and one ``mooncake_master`` on loopback for the
whole session (the tier and engine tests share it; a test that kills a master starts its own)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from hybridkv.tiers import MooncakeMaster


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as master:
        yield master


settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
