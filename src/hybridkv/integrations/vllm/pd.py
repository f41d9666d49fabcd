"""``HybridKVPDConnector``: vLLM PD mode: a prefill vLLM hands a request's KV blocks to a decode vLLM.

Loaded by this name with ``kv_role`` ``kv_producer`` (prefill) or ``kv_consumer`` (decode);
``HybridKVConnector`` (offload mode) refuses those roles and names this one. The protocol is vLLM's own
(as its NIXL and Mooncake connectors): a proxy (``pd_proxy.py``) sends the prompt to the prefill
server with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``; the prefill
scheduler's ``request_finished`` keeps the request's blocks (delay-free) and answers
``kv_transfer_params`` naming its engine, its sender's endpoint, its request id and its block
ids per KV cache group; the proxy sends the prompt with those params to the decode server,
whose ``get_num_new_matched_tokens`` answers the prompt's uncomputed tokens as an asynchronous
load. The decode worker asks the prefill worker for the blocks (``pd_agent.PDReceiver``: where
each block position lands in its own cache); the prefill worker pairs the layers by global layer
id, checks every pair (dtype, block size, window, shape) and writes the bytes over hybridkv's
Mooncake transfer engine transport (``pd_agent.PDSender``), then frees the blocks; blocks no
decode asked for are freed after ``pd_hold_s``.

What moves: full-attention and sliding-window groups by block position (for a window group the
blocks the decode side allocated, its window; a position the prefill side no longer holds fails the
load), and recurrent-state (``MambaSpec``: GDN, Mamba) groups: as vLLM's Mooncake connector, the
prefill side computes all but the last prompt token (``on_new_request``), and its non-null state
blocks pair in order with the decode side's last non-null ones (a state block table is not
positional); the decode side computes the last token from that state. A group of another kind
(chunked-local, speculative state blocks) turns PD mode off for the model (the prefill answers no
params, the decode side computes every prompt), logged once.

Invariants:
- Fails closed: a load that was refused (layout mismatch, unknown or expired request, a
  position not held), failed in the transport, or got no answer in ``pd_wait_s`` is reported in
  ``failed_recving`` and vLLM recomputes the request (run with ``kv_load_failure_policy
  "recompute"``); a load reported done had every byte written.
- A prefill request's blocks are held only when it finished by length (``max_tokens``) with
  ``do_remote_decode``; they are freed exactly once: after the decode side's request was served
  (sent or refused) or after ``pd_hold_s``.
- A decode request tells the prefill side it is done with its blocks also when it loads nothing
  (a full local hit, params of another prompt) or was aborted before its blocks were allocated.
- A decode request loads only blocks computed from its own prompt: the params carry the number and a
  digest of the prompt tokens the prefill side computed, and a mismatch (a proxy pairing the wrong
  params with a request) loads nothing: the prompt is computed on the decode side.

Config (``kv_connector_extra_config``): ``pd_host`` (where the prefill worker listens and where
Mooncake binds; default ``127.0.0.1``), ``pd_port`` (the prefill worker's control port; required
on the prefill side), ``pd_hold_s`` (default 120), ``pd_wait_s`` (default 30). Both sides need the
cluster key (``HYBRIDKV_CLUSTER_KEY`` or ``HYBRIDKV_CLUSTER_KEY_FILE``) and the
``mooncake-transfer-engine`` package. One worker per side (no TP / PP yet).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import RequestStatus

from hybridkv.integrations.vllm.connector import group_layouts
from hybridkv.integrations.vllm.layout import GroupKind, fingerprint
from hybridkv.integrations.vllm.pd_agent import NULL, CacheLayer, Load, PDReceiver, PDSender, build_layout
from hybridkv.spec.pools import RECURRENT_POOL, FullPool, WindowPool
from hybridkv.transfer.auth import load_cluster_key
from hybridkv.transfer.errors import TransferError
from hybridkv.transfer.transport import make_transport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

PARAMS = ("remote_engine_id", "remote_endpoint", "remote_request_id")


@dataclass
class PDMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: requests to hold for a decode side, loads to start."""

    holds: dict[str, list[list[int]]] = field(default_factory=dict)
    loads: list[Load] = field(default_factory=list)


def _is_state(spec: object) -> bool:
    """A recurrent (Mamba / GDN) group PD mode moves: its running state blocks, in any cache mode, without
    speculative blocks."""
    return (
        type(spec) is MambaSpec
        and not getattr(spec, "num_speculative_blocks", 0)
        and not getattr(spec, "num_prefill_checkpoint_blocks", 0)
    )


def digest(tokens: Sequence[int]) -> str:
    """What the prefill side computed, as the decode side checks it: a digest of the prompt's token ids."""
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).hexdigest()


def _valid(params: dict[str, Any]) -> bool:
    """The decode side's params name the prefill engine, its sender and its request."""
    return all(isinstance(params.get(k), str) and params[k] for k in PARAMS)


class HybridKVPDConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM PD mode over hybridkv's transfer layer (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = cfg.kv_connector_extra_config or {}
        self.producer = cfg.kv_role == "kv_producer"
        if cfg.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(
                f"HybridKVPDConnector: kv_role {cfg.kv_role!r}; PD mode is kv_producer (prefill) or "
                "kv_consumer (decode); use kv_both for the offload connector"
            )
        par = vllm_config.parallel_config
        if par.world_size > 1:
            raise ValueError(
                f"HybridKVPDConnector: {par.world_size} workers (tensor parallel {par.tensor_parallel_size}, pipeline "
                f"parallel {par.pipeline_parallel_size}); PD mode supports one worker per side yet: run tp=pp=1"
            )
        self.engine_id = str(cfg.engine_id)
        self.host = str(extra.get("pd_host", "127.0.0.1"))
        port = extra.get("pd_port")
        if self.producer and not port:
            raise ValueError(
                "HybridKVPDConnector (kv_producer): kv_connector_extra_config needs pd_port, the port the prefill "
                "worker listens on for decode requests"
            )
        self.endpoint = f"tcp://{self.host}:{int(port)}" if port else ""
        self.hold_s = float(extra.get("pd_hold_s", 120.0))
        self.wait_s = float(extra.get("pd_wait_s", 30.0))
        self.groups = group_layouts(kv_cache_config)
        self.state = [_is_state(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
        """Per group: a recurrent state group (one running state, not positional)."""
        self.has_state = any(self.state)
        bad = [g for g in self.groups if g.kind not in (GroupKind.FULL, GroupKind.WINDOW) and not self.state[g.index]]
        sizes = {g.block_size for g in self.groups}
        self.why_off = "; ".join(f"group {g.index} is {g.kind.value} ({g.why})" for g in bad)
        if len(sizes) > 1:
            self.why_off = self.why_off or f"groups with different block sizes {sorted(sizes)}"
        if not self.groups:
            self.why_off = "no KV cache groups"
        if self.why_off:
            logger.warning("HybridKVPDConnector: PD transfer off for this model, requests recompute (%s)", self.why_off)
        self.block_size = self.groups[0].block_size if self.groups else 0
        mc = vllm_config.model_config
        try:
            hf = mc.hf_config.to_dict()
            hf = {k: v for k, v in hf.items() if k not in ("torch_dtype", "dtype")}  # dtype: checked per layer
            text = json.dumps(hf, sort_keys=True, default=str)
        except Exception:  # a config that cannot be dumped: its repr
            text = repr(mc.hf_config)
        self.model = f"{mc.served_model_name or mc.model}.{fingerprint(text)}"
        # scheduler side
        self._null_block = 0
        self._local: dict[str, int] = {}
        self._holds: dict[str, list[list[int]]] = {}
        self._loads: list[Load] = []
        self.stats: dict[str, int] = {"holds": 0, "loads": 0, "releases": 0, "load_tokens": 0, "refused_params": 0}
        # worker side
        self.sender: PDSender | None = None
        self.receiver: PDReceiver | None = None

    # ==============================================================================================
    # worker side
    # ==============================================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.why_off:
            return
        num_blocks = self._kv_cache_config.num_blocks
        layers = []
        for g in self.groups:
            pool = str(WindowPool(g.window)) if g.kind is GroupKind.WINDOW and g.window else str(FullPool())
            for name in g.layer_names:
                value = kv_caches[name]
                tensors = [value] if isinstance(value, torch.Tensor) else list(value)
                for i, t in enumerate(tensors):
                    dim = 0 if t.shape[0] == num_blocks else 1
                    if t.dim() < 2 or t.shape[dim] != num_blocks:
                        raise TransferError(
                            f"HybridKVPDConnector: layer {name}: no block dimension of {num_blocks} in {tuple(t.shape)}"
                        )
                    if self.state[g.index]:  # a recurrent layer's states (conv, SSM ...), one page per block
                        layers.append(CacheLayer(name, g.index, t, dim, str(RECURRENT_POOL), g.block_size, f"s{i}."))
                    else:
                        layers.append(CacheLayer(name, g.index, t, dim, pool, g.block_size))
        bufs, groups = build_layout(self.model, layers)
        try:
            key = load_cluster_key()
            transport = make_transport("mooncake", host=self.host, protocol="tcp")
        except TransferError as exc:
            raise RuntimeError(f"HybridKVPDConnector ({self._kv_transfer_config.kv_role}): {exc}") from None
        if self.producer:
            self.sender = PDSender(self.engine_id, bufs, groups, transport, self.endpoint, key, self.hold_s)
        else:
            self.receiver = PDReceiver(self.engine_id, bufs, groups, transport, key, self.wait_s)
        logger.info(
            "HybridKVPDConnector: %s %s, %d cache entries, mooncake session %s",
            "prefill sender at" if self.producer else "decode receiver",
            self.endpoint or self.engine_id,
            len(bufs.entries),
            transport.session,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDMetadata)
        if self.sender is not None:
            for rid, blocks in meta.holds.items():
                self.sender.hold(rid, blocks)
        if self.receiver is not None:
            for load in meta.loads:
                self.receiver.submit(load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole requests, before the request is scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # the prefill side sends on the decode side's request, from the held blocks

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending = self.sender.finished() if self.sender is not None else set()
        done, failed = self.receiver.results() if self.receiver is not None else (set(), set())
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=done | failed, failed_recving=failed
        )

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()

    def worker_report(self) -> dict[str, Any]:
        if self.sender is not None:
            return {"sender": {**vars(self.sender.stats), "errors": list(self.sender.stats.errors)}}
        if self.receiver is not None:
            return {"receiver": {**vars(self.receiver.stats), "errors": list(self.receiver.stats.errors)}}
        return {"why_off": self.why_off}

    # ==============================================================================================
    # scheduler side
    # ==============================================================================================

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._null_block = gpu_block_pool.null_block.block_id

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if self.producer or self.why_off or not params or not params.get("do_remote_prefill") or not _valid(params):
            return 0, False
        # with a state group the prefill side computed all but the last prompt token (on_new_request): the
        # state after them is what moves, and this side computes the last token from it
        n = request.num_prompt_tokens - self.has_state
        tokens = request.prompt_token_ids
        if params.get("remote_num_tokens") != n or tokens is None or params.get("remote_prompt") != digest(tokens[:n]):
            self.stats["refused_params"] += 1  # not this prompt's blocks: computed here (and released there)
            logger.warning(
                "HybridKVPDConnector: request %s: its kv_transfer_params describe another prompt (%s tokens, this "
                "one %d); not loaded, computed here",
                request.request_id,
                params.get("remote_num_tokens"),
                n,
            )
            return 0, False
        self._local[request.request_id] = num_computed_tokens
        count = n - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.producer or not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if not _valid(params):
            return
        local = self._local.pop(request.request_id, 0)
        wanted: dict[int, list[int]] = {}
        error = ""
        if num_external_tokens > 0 and not self.why_off:
            bs = self.block_size
            start, end = local // bs, -(-(local + num_external_tokens) // bs)
            remote = params.get("remote_block_ids")
            for g, ids in enumerate(blocks.get_block_ids()):
                if self.state[g]:
                    wanted[g], error = self._state_blocks(g, ids, remote)
                    if error:
                        break
                    continue
                wanted[g] = [
                    ids[i] if start <= i < len(ids) and ids[i] != self._null_block else NULL for i in range(end)
                ]
            self.stats["loads"] += 1
            self.stats["load_tokens"] += num_external_tokens
        else:
            self.stats["releases"] += 1
        self._loads.append(self._load(request.request_id, params, {} if error else wanted, error))

    def _state_blocks(self, g: int, ids: list[int], remote: Any) -> tuple[list[int], str]:
        """A state group's destinations per prefill position: the state blocks are not positional (vLLM
        nulls and moves them), so the prefill's non-null blocks (its ``remote_block_ids``) pair in order
        with this side's last non-null ones. ``(positions, why not)``."""
        if not isinstance(remote, list) or len(remote) != len(self.groups) or not isinstance(remote[g], list):
            return [], f"kv_transfer_params remote_block_ids name no block list for state group {g}"
        held = [p for p, b in enumerate(remote[g]) if isinstance(b, int) and b != NULL]
        mine = [b for b in ids if b != self._null_block]
        if len(mine) < len(held) or not held:
            return [], (
                f"state group {g}: prefill holds {len(held)} state blocks, this decode side allocated {len(mine)}; "
                "run both sides with the same prefix caching (mamba_cache_mode)"
            )
        out = [NULL] * len(remote[g])
        for p, b in zip(held, mine[-len(held) :], strict=True):
            out[p] = b
        return out, ""

    def _load(self, request_id: str, params: dict[str, Any], wanted: dict[int, list[int]], error: str = "") -> Load:
        return Load(
            request_id,
            str(params["remote_request_id"]),
            str(params["remote_engine_id"]),
            str(params["remote_endpoint"]),
            wanted,
            error,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PDMetadata(holds=self._holds, loads=self._loads)
        self._holds, self._loads = {}, []
        return meta

    def on_new_request(self, request: Request) -> None:
        """Prefill side, a model with a state group: the last prompt token is left to the decode side, so
        the state sent is the one after all the others (the decode side computes that token from it)."""
        params = request.kv_transfer_params
        if (
            not self.producer
            or not self.has_state
            or self.why_off
            or not params
            or not params.get("do_remote_decode")
            or params.get("_hybridkv_truncated")
            or request.num_prompt_tokens < 2
            or request.prompt_token_ids is None
        ):
            return
        request.prompt_token_ids.pop()
        request._all_token_ids.pop()
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_hybridkv_truncated"] = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        self._local.pop(request.request_id, None)
        if not params:
            return False, None
        if not self.producer:
            if params.get("do_remote_prefill") and _valid(params):  # aborted before allocation: release
                params["do_remote_prefill"] = False
                self.stats["releases"] += 1
                self._loads.append(self._load(request.request_id, params, {}))
            return False, None
        if (
            self.why_off
            or not params.get("do_remote_decode")
            or request.status != RequestStatus.FINISHED_LENGTH_CAPPED
            or not any(block_ids)
        ):
            return False, None
        held = [[NULL if b == self._null_block else b for b in ids] for ids in block_ids]
        self._holds[request.request_id] = held
        self.stats["holds"] += 1
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_endpoint": self.endpoint,
            "remote_request_id": request.request_id,
            "remote_block_ids": held,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_prompt": digest(request.prompt_token_ids or ()),
        }

    def scheduler_report(self) -> dict[str, Any]:
        return {"stats": dict(self.stats), "why_off": self.why_off}
