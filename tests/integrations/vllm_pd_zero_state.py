"""A test double vLLM loads (``kv_connector_module_path``), never used outside the PD test: the decode side of
``HybridKVPDConnector`` with every recurrent-state block a load filled zeroed before vLLM reads it, what a
PD connector that moves the KV blocks but not the state leaves. Its tokens must differ from the reference:
the equality of the real connector's tokens rests on the state it moved."""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from hybridkv.integrations.vllm.pd import HybridKVPDConnector
from hybridkv.integrations.vllm.pd_agent import NULL


class ZeroStatePDConnector(HybridKVPDConnector):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._states = [
            t
            for g in self.groups
            if self.state[g.index]
            for name in g.layer_names
            for t in ([kv_caches[name]] if isinstance(kv_caches[name], torch.Tensor) else list(kv_caches[name]))
        ]
        self._filled: dict[str, list[int]] = {}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        for load in self._get_connector_metadata().loads:  # type: ignore[attr-defined]
            ids = [b for g, blocks in load.blocks.items() if self.state[g] for b in blocks if b != NULL]
            self._filled[load.request_id] = ids
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        for rid in results.finished_recving - results.failed_recving:
            ids = torch.tensor(self._filled.pop(rid, []), dtype=torch.long)
            for t in self._states:
                t.index_fill_(0, ids, 0)
        return results
