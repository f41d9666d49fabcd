"""Fixtures shared by the transfer tests: one cluster key per test, a bootstrap that uses it."""

from __future__ import annotations

import pytest

from hybridkv.transfer import BootstrapServer, ClusterKey


@pytest.fixture
def key() -> ClusterKey:
    return ClusterKey.generate()


@pytest.fixture
def bootstrap(key):
    server = BootstrapServer(key=key).start()
    yield server
    server.close()
