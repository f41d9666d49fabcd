"""The device mirror of a host table: equal after every flush, bounded pending list."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.memory.mirror import MirroredTable

writes = st.lists(
    st.tuples(st.lists(st.integers(0, 63), min_size=1, max_size=20), st.integers(-1, 1000), st.booleans()),
    max_size=30,
)


@given(writes)
def test_unshared_mirror_equals_host_after_every_flush(ops):
    table = MirroredTable(64, torch.device("cpu"), share_cpu=False)  # the GPU code path
    for index, value, flush in ops:
        table.set(np.array(index), value)
        assert len(table._dirty) == 0 or table._dirty_entries * 4 < 64  # bounded
        if flush:
            assert np.array_equal(table.device.numpy(), table.host)
    assert np.array_equal(table.device.numpy(), table.host)


def test_a_shared_cpu_table_is_the_host_array():
    table = MirroredTable(8, torch.device("cpu"))
    table.set(np.array([3]), 7)
    assert table.device.data_ptr() == table.host.ctypes.data and int(table.device[3]) == 7
