"""hybridkv inside vLLM: ``HybridKVConnector``, a V1 KV connector (offload mode) over hybridkv's host tier.

``HybridKVConnector`` (``connector.py``) imports vLLM, on first access (``scripts/setup_vllm.sh``
installs the CPU build); the engine-neutral half (keys, the hit rule) is ``layout.py`` and imports
no vLLM. See ``connector.py`` for where the store lives, the invariants and the install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.integrations.vllm.connector import HybridKVConnector, HybridKVMetadata, HybridKVWorkerMeta

__all__ = ["HybridKVConnector", "HybridKVMetadata", "HybridKVWorkerMeta"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # vLLM's loader: getattr(import_module("hybridkv.integrations.vllm"), name)
        from hybridkv.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
