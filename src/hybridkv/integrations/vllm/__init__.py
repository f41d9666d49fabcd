"""hybridkv inside vLLM: ``HybridKVConnector``, a V1 KV connector (offload mode) over hybridkv's host tier,
and ``HybridKVPDConnector`` (PD mode: a prefill vLLM hands KV blocks to a decode vLLM).

``HybridKVConnector`` (``connector.py``) and ``HybridKVPDConnector`` (``pd.py``) import vLLM, on first
access (``scripts/setup_vllm.sh`` installs the CPU build); the engine-neutral halves (keys, the hit
rule: ``layout.py``; PD layouts, wire and bytes: ``pd_agent.py``; the proxy: ``pd_proxy.py``) import
no vLLM. See ``connector.py`` for where the store lives, ``pd.py`` for PD mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.integrations.vllm.connector import HybridKVConnector, HybridKVMetadata, HybridKVWorkerMeta
    from hybridkv.integrations.vllm.pd import HybridKVPDConnector

__all__ = ["HybridKVConnector", "HybridKVMetadata", "HybridKVPDConnector", "HybridKVWorkerMeta"]


def __getattr__(name: str) -> Any:
    if name == "HybridKVPDConnector":
        from hybridkv.integrations.vllm import pd

        return pd.HybridKVPDConnector
    if name in __all__:  # vLLM's loader: getattr(import_module("hybridkv.integrations.vllm"), name)
        from hybridkv.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
