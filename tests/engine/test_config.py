"""EngineConfig: every refusal is a ValueError naming the field, raised when the config is built."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from hybridkv.engine.config import EngineConfig


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"gpu_memory": 0}, "gpu_memory must be > 0 bytes"),
        ({"gpu_memory": "lots"}, "cannot read 'lots' as a size"),
        ({"page_size": 0}, "page_size must be >= 1"),
        ({"max_context": 0}, "max_context must be >= 1"),
        ({"max_running": 0}, "max_running 0"),
        ({"max_step_tokens": 0}, "max_step_tokens 0"),
        ({"cache_policy": "fifo"}, "unknown cache_policy 'fifo'; known: lru"),
        ({"checkpoints": "interval:3"}, "positive multiple of the page size 16"),
        ({"store": "s3"}, "store must be one of"),
        ({"store_master": "127.0.0.1:1"}, "it needs store='mooncake'"),
        ({"host_memory": "8MiB", "prefix_cache": False}, "they need prefix_cache=True"),
        ({"host_memory": 0}, "host_memory must be > 0 bytes"),
        ({"store": "mooncake", "store_memory": "1MiB"}, "store_memory must be at least 16 MiB"),
        ({"tier_policy": "around"}, "unknown tier_policy 'around'"),
    ],
)
def test_a_field_out_of_range_is_refused_by_name(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        EngineConfig(**fields)


def test_derived_fields_and_pickling() -> None:
    config = EngineConfig(page_size=4, chunk_size=8, host_memory="8MiB")
    assert config.step_tokens == 16 * 8 and config.memory_bytes == 256 << 20 and config.tiered
    assert config.placement.startswith("interval:8")
    assert pickle.loads(pickle.dumps(config)) == config
