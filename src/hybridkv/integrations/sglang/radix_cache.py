"""``HybridKVRadixCache``: SGLang 0.5.23's ``BasePrefixCache`` contract over hybridkv's prefix cache.

The tree, the hit rule, the locks and the eviction order are hybridkv's ``HybridRadixCache``
(``hybridkv.cache``): a hit is returned only where full KV, the sliding window before its end
and a Mamba state exactly at its end are all cached. SGLang's allocators keep owning the
bytes: the tree holds SGLang's token locations and Mamba slots through an ``IdMap`` onto a
shadow ``UnifiedMemory`` (``idmap.py``), and every eviction hybridkv decides is carried out on
SGLang's pools by a residency hook (full pages: ``free`` / ``free_full``; window pages:
``free_swa``; state checkpoints: ``mamba_allocator.free``).

Contract kept (``base_prefix_cache.py`` of 0.5.23):
- ``match_prefix`` returns ``device_prefix_len`` (page-aligned, valid for every component) and
  the node ending there; ``path_device_indices(node)`` gives its token locations. It never
  allocates or frees.
- ``insert`` takes the key and its locations (and ``mamba_value``, the state after the whole
  key); it returns ``prefix_len``, the tokens cached already, and frees the caller's own locations of
  ``[prev_prefix_len, prefix_len)`` itself, as 0.5.23's default tree (``UnifiedRadixCache``) does
  (the legacy ``RadixCache`` leaves that to its caller); ``mamba_exist`` says the caller's state
  slot was not kept (the caller frees it).
- ``evict`` frees at least what it is asked for when enough is unlocked, and reports what it
  freed per component; ``inc_lock_ref`` / ``dec_lock_ref`` count per node: an unlock with no
  lock open on that node is an error, never a silent no-op.
- ``checkpoint(req, up_to)`` (the scheduler's write-back, chunked prefill and finish) follows
  ``UnifiedRadixCache.checkpoint_into_tree`` per component: it frees nothing of the request's
  row (``release_kv_cache`` does) but the duplicates ``insert`` frees, and, with SWA, the
  request's own window slots behind its window (SGLang's ``free_swa_out_of_window_slots``: the
  cursor lives on the request); it rewrites the row's ``[cache_protected_len, n)`` to the
  tree's locations, moves ``req.lock`` onto the node ending at ``n`` and advances
  ``cache_protected_len`` / ``cache_inserted_len``. Mamba (no extra buffer): an unfinished
  request keeps its slot and the tree gets a copy (a fresh slot, freed if the tree had a state
  there); a finished one hands its slot over, or frees it (``free_mamba_cache``) when the tree
  had one. SWA: a pending ``swa_branching_seqlen`` stops the insert at the branch first.
- ``match_prefix(cow_mamba=True)`` on a hit with a state gives the request a slot of its own
  (evicting one unlocked state if none is free, the matched one locked meanwhile) and names the
  cached slot as ``req.kv.mamba_cow_src_index``; the tree's slot is never handed out.
- Argument errors (a key that is not a ``RadixKey``, locations that are not an integer tensor,
  a node of another cache) raise ``HybridKVSGLangError`` with what to change; nothing changed.

Host reads: the tree runs on host ids, so ``insert`` copies the value tensor to the host once
(one device->host read per insert on a GPU; SGLang's own ``RadixCache`` keys are host-side
too; with SWA the full->SWA mapping of the same locations rides in that one copy, so that pages
whose window the request freed enter the tree tombstoned). A ``mamba_value`` slot is read as
one host int. ``match_prefix`` (copy-on-write included: the slot table is on the host),
``evict`` and the locks read nothing from the device; ``path_device_indices`` writes one
host->device copy. ``checkpoint`` adds no read of its own (the Mamba state copy runs on the
device; the duplicate frees of an SWA insert read their mapping, as before).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
from sglang.srt.mem_cache.radix_cache import RadixKey

from hybridkv.cache import PAGE_NEED, CacheLock, ComponentKind, HybridRadixCache, Node
from hybridkv.integrations.sglang.idmap import IdMap, SGLangIdError, shadow_memory
from hybridkv.spec import PoolId


class HybridKVSGLangError(ValueError):
    """A call SGLang's contract allows but this cache cannot serve, or bad input; says what to change."""


class _Evictions:
    """The residency hook: carries hybridkv's evictions out on SGLang's pools and counts them."""

    def __init__(self, owner: HybridKVRadixCache):
        self.owner = owner
        self.tokens = 0
        self.swa_tokens = 0
        self.states = 0

    def stored(self, node: Node, kind: ComponentKind, pool: PoolId | None) -> None:
        return None

    def evicting(self, node: Node, kind: ComponentKind, pool: PoolId | None) -> None:
        o = self.owner
        if kind is ComponentKind.CHECKPOINT:
            sg = o.ids.unbind_slot(node.checkpoint)
            o.req_to_token_pool.mamba_allocator.free(torch.tensor([sg], dtype=torch.int64, device=o.mamba_device))
            self.states += 1
            return
        if kind is ComponentKind.WINDOW:
            assert pool is not None
            resident = node.pages[o.ids.mem.pools[pool].resident(node.pages)]
            o.allocator.free_swa(o.locations(o.ids.sg_pages_of(resident)))
            self.swa_tokens += int(resident.size) * o.page_size
            return
        locs = o.locations(o.ids.unbind_pages(node.pages))
        if o.has_swa:
            o.allocator.free_full(locs)  # the window part went first (a WINDOW call, or tombstoned before)
        else:
            o.allocator.free(locs)
        self.tokens += int(node.pages.size) * o.page_size


class HybridKVRadixCache(BasePrefixCache):
    """SGLang's radix-cache contract, answered by hybridkv's ``HybridRadixCache``."""

    def __init__(self, params: CacheInitParams, *, swa: bool = False, mamba: bool = False):
        if params.disable:
            raise HybridKVSGLangError(
                "--radix-cache-backend hybridkv with --disable-radix-cache: a disabled cache has nothing "
                "for hybridkv to do; drop one of the two flags"
            )
        if params.is_eagle:
            raise HybridKVSGLangError(
                "hybridkv's SGLang cache does not key bigram (EAGLE) trees; run without speculative "
                "decoding or without --radix-cache-backend hybridkv"
            )
        self.disable = False
        self.is_eagle = False
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.allocator = params.token_to_kv_pool_allocator
        self.page_size = int(params.page_size)
        self.has_swa = swa
        self.has_mamba = mamba
        self._window: int | None = None
        if swa:
            window = params.swa_retain_window
            if window is None or window <= 0 or not hasattr(self.allocator, "free_swa"):
                raise HybridKVSGLangError(
                    f"hybridkv SWA cache: needs a positive sliding_window_size (got {window}) and an SWA "
                    f"allocator with free_swa (got {type(self.allocator).__name__})"
                )
            self._window = int(window)
        self.mamba_device: torch.device | str = "cpu"
        self._sg_slots = 0
        if mamba:
            mamba_allocator = getattr(self.req_to_token_pool, "mamba_allocator", None)
            if mamba_allocator is None:
                raise HybridKVSGLangError(
                    "hybridkv Mamba cache: the req_to_token_pool has no mamba_allocator (expected a "
                    f"HybridReqToTokenPool, got {type(self.req_to_token_pool).__name__})"
                )
            self._sg_slots = int(self.req_to_token_pool.mamba_pool.size)
            self.mamba_device = self.req_to_token_pool.device
        size = getattr(self.allocator, "size_full", None) or self.allocator.size
        self._sg_pages = int(size) // self.page_size + 1
        self.device = torch.device(self.allocator.device) if isinstance(self.allocator.device, str) else "cpu"
        self.reset()

    # --- build ------------------------------------------------------------------------------

    def reset(self) -> None:
        """A fresh, empty tree (like SGLang's caches, it drops the tree without freeing its ids)."""
        mem = shadow_memory(self.page_size, self._sg_pages, self._window, self._sg_slots if self.has_mamba else None)
        self.ids = IdMap(mem, self._sg_pages, self._sg_slots)
        self.tree = HybridRadixCache(mem)
        self.evictions = _Evictions(self)
        self.tree.set_residency_hook(self.evictions)
        rules = self.tree.rules
        self._window_pool = rules.windows[0].pool_id if rules.windows else None
        self._state_pool = rules.checkpoint.pool_id if rules.checkpoint is not None else None
        self._locks: dict[int, list[CacheLock]] = {}
        self._protected = 0

    # --- keys and values --------------------------------------------------------------------

    def _key(self, key: object, what: str) -> tuple[np.ndarray, object]:
        if not isinstance(key, RadixKey):
            raise HybridKVSGLangError(f"{what}: expected a RadixKey, got {type(key).__name__} {key!r:.80}")
        if key.is_bigram:
            raise HybridKVSGLangError(f"{what}: bigram (EAGLE) keys are not supported by the hybridkv backend")
        raw = key.raw_token_ids()
        if isinstance(raw, np.ndarray):
            toks = raw.astype(np.int64, copy=False)
        elif getattr(raw, "typecode", None) == "q":
            toks = np.frombuffer(raw, dtype=np.int64) if len(raw) else np.empty(0, dtype=np.int64)
        else:
            try:
                toks = np.asarray(raw)
            except (TypeError, ValueError) as exc:
                raise HybridKVSGLangError(f"{what}: token ids must be integers, got {raw!r:.80}") from exc
            if toks.ndim != 1 or (toks.size and toks.dtype.kind not in "iu"):
                raise HybridKVSGLangError(
                    f"{what}: token ids must be a 1-D sequence of ints (array('q') as SGLang builds them), "
                    f"got {type(raw).__name__} of {toks.dtype} shape {toks.shape}"
                )
            toks = toks.astype(np.int64)
        namespace = None if key.extra_key is None and key.cache_salt is None else (key.extra_key, key.cache_salt)
        return toks, namespace

    def locations(self, sg_pages: np.ndarray) -> torch.Tensor:
        """SGLang token locations of whole SGLang pages, on the allocator's device."""
        ps = self.page_size
        locs = (sg_pages[:, None] * ps + np.arange(ps)).reshape(-1) if ps > 1 else sg_pages
        return torch.from_numpy(np.ascontiguousarray(locs, dtype=np.int64)).to(self.device)

    def _pages_of_value(self, value: object, n: int, what: str) -> tuple[np.ndarray, np.ndarray | None]:
        """The SGLang pages of the first ``n`` locations of ``value`` (whole pages, in order) and,
        with SWA, per page whether its window part is gone (SGLang's full->SWA mapping reads 0 at
        its first location: the request freed it behind its window), read in the same host copy."""
        if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise HybridKVSGLangError(
                f"{what}: value must be an integer tensor of token locations (the request's row of "
                f"req_to_token), got {type(value).__name__} {getattr(value, 'dtype', '')}"
            )
        if value.ndim != 1 or value.numel() < n:
            raise HybridKVSGLangError(
                f"{what}: value has shape {tuple(value.shape)} but the key has {n} page-aligned tokens; "
                "pass one location per key token"
            )
        ps = self.page_size
        dev = value[:n].to(torch.int64)
        no_window: np.ndarray | None = None
        if self.has_swa:
            mapping = self.allocator.full_to_swa_index_mapping
            # clamped for the gather only: an out-of-range location is refused on the host (bind_pages)
            peer = mapping[dev.clamp(0, mapping.numel() - 1)].to(torch.int64)
            both = torch.stack((dev, peer)).to("cpu")
            locs = both[0].numpy()  # the one host read of an insert (with the mapping beside it)
            no_window = both[1].numpy()[::ps] == 0
        else:
            locs = dev.to("cpu").numpy()  # the one host read of an insert
        pages = locs[::ps] // ps
        if ps > 1 and n and np.count_nonzero(locs != (np.repeat(pages, ps) * ps + np.tile(np.arange(ps), n // ps))):
            raise HybridKVSGLangError(
                f"{what}: locations are not whole pages of {ps} (token k of a page at offset k of one page); "
                "SGLang's paged allocators hand them out that way: pass the row as allocated"
            )
        return pages, no_window

    # --- match ------------------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        toks, ns = self._key(getattr(params, "key", params), "match_prefix")
        res = self.tree.match_prefix(toks, ns)
        if params.cow_mamba and res.checkpoint is not None:
            self._cow_mamba(params, res.node, res.checkpoint)
        return MatchResult(
            device_prefix_len=res.length,
            last_device_node=res.node,
            last_host_node=res.node,
            best_match_node=res.node,
            swa_branching_seqlen=res.checkpoint_at if self.has_swa else None,
            mamba_branching_seqlen=res.checkpoint_at if self.has_mamba else None,
            full_kv_hit_length=res.full_length,
        )

    def path_device_indices(self, node: Any) -> torch.Tensor:
        self._node(node, "path_device_indices")
        return self.locations(self.ids.sg_pages_of(node.path_pages))

    # --- insert -----------------------------------------------------------------------------

    def insert(self, params: InsertParams) -> InsertResult:
        if params.key is None:
            raise HybridKVSGLangError("insert: InsertParams.key is None; pass the RadixKey of the cached tokens")
        toks, ns = self._key(params.key, "insert")
        ps = self.page_size
        n = toks.size // ps * ps
        if params.value is None:
            raise HybridKVSGLangError("insert: InsertParams.value is None; pass the locations of the key's tokens")
        sg_pages, no_window = self._pages_of_value(params.value, n, "insert")
        mamba = params.mamba_value
        if mamba is not None and not self.has_mamba:
            raise HybridKVSGLangError("insert: mamba_value given to a cache built without a Mamba component")
        if self.has_mamba and mamba is not None and n != toks.size:
            raise HybridKVSGLangError(
                f"insert: a Mamba state after {toks.size} tokens cannot be cached with page size {ps} "
                f"(the key's page-aligned part ends at {n}); insert a page-aligned key"
            )
        if sg_pages.size != np.unique(sg_pages).size:
            raise HybridKVSGLangError("insert: a location page appears twice in value; each page holds one key page")
        try:
            hk_pages, fresh = self.ids.bind_pages(sg_pages)
        except SGLangIdError as exc:
            raise HybridKVSGLangError(str(exc)) from exc
        if no_window is not None and self._window_pool is not None:
            # the caller's own pages whose SWA part it freed already (its window slid past them,
            # SGLang's free_swa_out_of_window_slots): their shadow pages enter the tree tombstoned,
            # so no eviction frees a window cell SGLang gave back
            gone = fresh & no_window
            if gone.any():
                self.ids.mem.windows.free(hk_pages[gone], self._window_pool)
        checkpoints = None
        slot_fresh = False
        hk_slot = -1
        if mamba is not None and n:
            sg_slot = int(mamba.reshape(-1)[0])  # one slot, a host int (SGLang's tree reads it too)
            hk_slot, slot_fresh = self.ids.bind_slot(sg_slot)
            checkpoints = {n: hk_slot}
        try:
            result = self.tree.insert(
                toks[:n], hk_pages, extra_key=ns, checkpoints=checkpoints, priority=params.priority
            )
        except Exception:
            self.ids.release_pages(hk_pages[fresh])
            if slot_fresh:
                self.ids.release_slot(hk_slot)
            raise
        if result.duplicates.size:
            self.ids.release_pages(result.duplicates)
        mamba_exist = False
        if hk_slot >= 0 and hk_slot in result.unused_checkpoints:
            mamba_exist = True
            self.ids.release_slot(hk_slot)
        elif mamba is not None and n == 0:
            mamba_exist = True
        if result.adopted_pages and self.has_swa:
            self._adopt_swa(result, sg_pages)
        self._free_duplicates(params.value, int(params.prev_prefix_len), result.prefix_len)
        return InsertResult(
            prefix_len=result.prefix_len, total_len=n, last_device_node=result.node, mamba_exist=mamba_exist
        )

    def _free_duplicates(self, value: torch.Tensor, start: int, end: int) -> None:
        """Free the caller's locations of ``[start, end)``: tokens the tree held already (0.5.23's
        ``UnifiedRadixCache`` contract: its insert frees them, ``prev_prefix_len`` marking where the
        caller's own locations begin). With SWA, a location whose window part is gone (the request's
        window slid past it, or the tree adopted it) frees its full part only (one host read of the
        full->SWA mapping)."""
        if end <= start:
            return
        dup = value[start:end].to(torch.int64)
        if not self.has_swa:
            self.allocator.free(dup)
            return
        mapped = self.allocator.full_to_swa_index_mapping[dup] > 0
        if bool(mapped.all()):
            self.allocator.free(dup)
            return
        self.allocator.free_full(dup[~mapped])
        if bool(mapped.any()):
            self.allocator.free(dup[mapped])

    def _adopt_swa(self, result: Any, caller_pages: np.ndarray) -> None:
        """hybridkv rebound window cells of the caller's duplicate pages onto cached pages whose
        window was evicted: do the same in SGLang's full->SWA mapping (read on the host: an
        insert that adopts is rare and already slow)."""
        cached = self.ids.sg_pages_of(result.pages[: caller_pages.size])
        differ = cached != caller_pages
        mapping = self.allocator.full_to_swa_index_mapping
        src = self.locations(caller_pages[differ])
        dst = self.locations(cached[differ])
        swa_src = mapping[src]
        swa_dst = mapping[dst]
        adopt = (swa_dst == 0) & (swa_src > 0)
        self.allocator.set_full_to_swa_mapping(dst[adopt], swa_src[adopt])
        self.allocator.clear_full_to_swa_mapping(src[adopt])

    # --- locks ------------------------------------------------------------------------------

    def _node(self, node: Any, what: str) -> Node:
        if not isinstance(node, Node):
            raise HybridKVSGLangError(
                f"{what}: expected a node from this cache's match_prefix or insert, got {type(node).__name__}"
            )
        if not node.is_root and not self.tree.tree.contains(node):
            raise HybridKVSGLangError(f"{what}: {node} is not in this cache (evicted, or another cache's node)")
        return node

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        node = self._node(node, "inc_lock_ref")
        newly = sum(n.end - n.start for n in node.path() if n.lock == 0)
        self._locks.setdefault(id(node), []).append(self.tree.lock(node))
        self._protected += newly
        return IncLockRefResult(delta=-newly)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if not isinstance(node, Node):
            raise HybridKVSGLangError(f"dec_lock_ref: expected a node from this cache, got {type(node).__name__}")
        held = self._locks.get(id(node))
        if not held:
            raise HybridKVSGLangError(
                f"dec_lock_ref: no lock is open on {node} (a second unlock of one lock, or a node never "
                "locked through inc_lock_ref); every dec_lock_ref must pair with one inc_lock_ref"
            )
        lock = held.pop()
        if not held:
            del self._locks[id(node)]
        path = lock.node.path()
        self.tree.unlock(lock)
        freed = sum(n.end - n.start for n in path if n.lock == 0)
        self._protected -= freed
        return DecLockRefResult(delta=freed)

    # --- eviction ---------------------------------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        ps = self.page_size
        needs: dict[Any, int] = {}
        if params.num_tokens > 0:
            needs[PAGE_NEED] = -(-int(params.num_tokens) // ps)
        if params.swa_num_tokens > 0:
            if self._window_pool is None:
                raise HybridKVSGLangError("evict: swa_num_tokens asked of a cache without an SWA component")
            needs[self._window_pool] = -(-int(params.swa_num_tokens) // ps)
        if params.mamba_num > 0:
            if self._state_pool is None:
                raise HybridKVSGLangError("evict: mamba_num asked of a cache without a Mamba component")
            needs[self._state_pool] = int(params.mamba_num)
        ev = self.evictions
        before = (ev.tokens, ev.swa_tokens, ev.states)
        if needs:
            self.tree.evict(needs)
        return EvictResult(
            num_tokens_evicted=ev.tokens - before[0],
            swa_num_tokens_evicted=ev.swa_tokens - before[1],
            mamba_num_evicted=ev.states - before[2],
        )

    # --- sizes and capabilities -------------------------------------------------------------

    def evictable_size(self) -> int:
        return self.tree.cached_tokens - self._protected

    def protected_size(self) -> int:
        return self._protected

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self._protected

    def swa_evictable_size(self) -> int:
        """Window tokens resident in unlocked nodes (a walk over the window nodes)."""
        if not self.tree.rules.windows:
            return 0
        nodes = self.tree.residency.window_nodes[0]
        return sum(n.window_resident[0] for n in nodes if n.window_lock == 0) * self.page_size

    def swa_protected_size(self) -> int:
        if not self.tree.rules.windows:
            return 0
        nodes = self.tree.residency.window_nodes[0]
        return sum(n.window_resident[0] for n in nodes if n.window_lock > 0) * self.page_size

    def mamba_evictable_size(self) -> int:
        return sum(1 for n in self.tree.residency.checkpoint_nodes if n.checkpoint_lock == 0)

    def mamba_protected_size(self) -> int:
        """Cached states a lock holds (SGLang's idle pool check: free + evictable + protected == pool)."""
        return sum(1 for n in self.tree.residency.checkpoint_nodes if n.checkpoint_lock > 0)

    def all_values_flatten(self) -> torch.Tensor:
        """Every SGLang token location the tree holds (SGLang's leak report; a host table walk)."""
        bound = self.ids.sg_of_page[self.ids.sg_of_page >= 0]
        return self.locations(np.sort(bound))

    def all_mamba_values_flatten(self) -> torch.Tensor:
        """Every SGLang Mamba slot the tree holds (SGLang's leak report)."""
        slots = np.sort(self.ids.sg_of_slot[self.ids.sg_of_slot >= 0])
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.mamba_device)

    def release_swa_prefix_lock(self, req: Any) -> None:
        """SGLang calls this once a decoding request is past its retain window, to let its prefix's
        window be evicted early. hybridkv's lock holds only the window before the locked node's end
        (at most one window of tokens per request), so the lock is kept until ``unlock``: stricter,
        never a window freed under a request that may still read it."""
        return None

    def sanity_check(self) -> None:
        """SGLang's optional tree check (``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK``): hybridkv's own."""
        self.check()

    def total_size(self) -> int:
        return self.tree.cached_tokens

    def supports_swa(self) -> bool:
        return self.has_swa

    def supports_mamba(self) -> bool:
        return self.has_mamba

    @property
    def sliding_window_size(self) -> int | None:
        return self._window

    @property
    def root_node(self) -> Node:
        """The root of the default namespace (a detached empty root while it holds nothing)."""
        root = self.tree.tree.roots.get(None)
        return root if root is not None else self.tree.tree.empty_root(None)

    def pretty_print(self) -> None:
        print(self.tree.stats())

    def check(self) -> None:
        """hybridkv's tree invariants and the id map's bijection (tests call it after every step)."""
        self.tree.check()
        bound = np.flatnonzero(self.ids.sg_of_page >= 0)
        if not np.array_equal(np.sort(bound), np.sort(self.tree.residency.owned.nonzero()[0])):
            raise HybridKVSGLangError("id map: bound shadow pages differ from the pages the tree holds")

    # --- Mamba copy-on-write -----------------------------------------------------------------

    def _mamba_extra_buffer(self) -> bool:
        pool = self.req_to_token_pool
        return bool(getattr(pool, "enable_mamba_extra_buffer", False)) or (
            getattr(pool, "mamba_ckpt_pool", None) is not None
        )

    def _refuse_mamba_variants(self, what: str) -> None:
        if self._mamba_extra_buffer():
            raise HybridKVSGLangError(
                f"{what}: SGLang's Mamba extra buffer (ping-pong track slots, --mamba-scheduler-strategy "
                "extra_buffer) and int8 checkpoint pools are not served by the hybridkv backend; run "
                "without them (the no-buffer strategy) or without --radix-cache-backend hybridkv"
            )

    def _alloc_mamba_slot(self, what: str, keep: Node | None = None) -> torch.Tensor:
        """One slot of SGLang's mamba allocator, evicting one cached state when none is free
        (``keep``, locked meanwhile, is the node whose state the caller is about to read)."""
        alloc = self.req_to_token_pool.mamba_allocator
        slot = alloc.alloc(1)
        if slot is None:
            lock = self.tree.lock(keep) if keep is not None and not keep.is_root else None
            try:
                self.evict(EvictParams(num_tokens=0, mamba_num=1))
            finally:
                if lock is not None:
                    self.tree.unlock(lock)
            slot = alloc.alloc(1)
        if slot is None:
            raise HybridKVSGLangError(
                f"{what}: no Mamba slot is free and every cached state is locked; raise "
                "--max-mamba-cache-size or run fewer requests at once"
            )
        return slot

    def _cow_mamba(self, params: MatchPrefixParams, node: Node, checkpoint: int) -> None:
        """``match_prefix(cow_mamba=True)`` on a hit with a state: give the request a slot of its
        own (unless it holds one) and name the cached state as its copy-on-write source; the
        scheduler copies it on its forward stream (0.5.23: ``mamba_cow_src_index``). The tree's
        slot is never handed out: the copy leaves it cached."""
        self._refuse_mamba_variants("match_prefix(cow_mamba=True)")
        req = params.req
        if req is None:
            raise HybridKVSGLangError(
                "match_prefix(cow_mamba=True): MatchPrefixParams.req is None; pass the request whose slot "
                "receives the copy"
            )
        sg_slot = int(self.ids.sg_of_slot[checkpoint])  # a host table: no device read
        if sg_slot < 0:
            raise HybridKVSGLangError(f"match_prefix: cached state {checkpoint} is bound to no SGLang slot (bug)")
        if not req.kv.holds_mamba:
            req.kv.mamba_pool_idx = self._alloc_mamba_slot("match_prefix(cow_mamba=True)", keep=node)[0]
        req.kv.mamba_cow_src_index = torch.tensor([sg_slot], dtype=torch.int64, device=self.mamba_device)
        req.kv.mamba_needs_clear = False

    def swa_retain_floor(self, req: Any) -> int | None:
        """With SWA and Mamba together, keep the window behind the request's last tracked state
        (a hit lands on a state); SWA alone: nothing deeper than the tail."""
        if not (self.has_swa and self.has_mamba) or self._window is None:
            return None
        seen = req.kv.mamba_last_track_seqlen
        return None if seen is None else int(seen) - self._window

    # --- the scheduler's write-back ---------------------------------------------------------

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """0.5.23's ``checkpoint``: insert the request's first ``up_to`` tokens, repoint its row
        at the tree's copy, move its lock to the node the insert ended on, advance
        ``cache_protected_len`` / ``cache_inserted_len``. Per component, as ``UnifiedRadixCache``:

        - SWA: a match that reported ``swa_branching_seqlen`` (full KV cached past the hit, its
          window gone) inserts only up to there first (the window the request recomputed
          restores that hit) and clears it; an unfinished request first frees its own window
          slots behind its window (SGLang's ``free_swa_out_of_window_slots``): those pages enter
          the tree tombstoned.
        - Mamba (no extra buffer, page size 1): an unfinished request keeps its slot and the tree
          gets a fresh slot holding a copy of its state (freed again if a state was cached
          there already); a finished one hands its own slot to the tree, or frees it
          (``free_mamba_cache``) when the tree had one there.

        Nothing else is freed: ``release_kv_cache`` frees ``[cache_protected_len, up_to)``."""
        if kwargs:
            raise HybridKVSGLangError(
                f"checkpoint: arguments {sorted(kwargs)} are for SGLang's streaming sessions, which the "
                "hybridkv backend does not serve; run without sessions"
            )
        kv = req.kv
        if kv.req_pool_idx is None:
            raise HybridKVSGLangError(f"checkpoint: request {req.rid} holds no req_to_token row (released already)")
        finished = bool(req.finished())
        token_ids = req.full_untruncated_fill_ids[:up_to]
        protected = int(kv.cache_protected_len)
        cache_len = len(token_ids)
        branch = None
        mamba_value: torch.Tensor | None = None
        if self.has_mamba:
            self._refuse_mamba_variants("checkpoint")
            if kv.mamba_pool_idx is None:
                raise HybridKVSGLangError(
                    f"checkpoint: request {req.rid} holds no Mamba slot (req.kv.mamba_pool_idx is None) in a "
                    "Mamba cache; allocate its row with HybridReqToTokenPool.alloc"
                )
            if finished:
                mamba_value = kv.mamba_pool_idx.reshape(1).clone()  # donated: the tree keeps it or it is freed
            else:
                mamba_value = self._alloc_mamba_slot("checkpoint")
                pool = self.req_to_token_pool
                translate = getattr(pool, "translate_mamba_indices", lambda x: x)
                pool.mamba_pool.copy_from(translate(kv.mamba_pool_idx.reshape(1)), translate(mamba_value))
        elif self.has_swa:
            b = req.swa_branching_seqlen
            if b is not None and protected < b <= cache_len:
                branch = int(b)
                cache_len = branch
        if self.has_swa and not finished and _free_out_of_window():
            self._free_out_of_window(req, cache_len - 1)
        ps = self.page_size
        n = cache_len // ps * ps
        if n <= 0:
            self._release_state(req, finished, mamba_value, inserted=False)
            return
        if protected > n:  # refused before the tree changes (SGLang's own tree asserts here)
            if mamba_value is not None and not finished:
                self.req_to_token_pool.mamba_allocator.free(mamba_value)
            raise HybridKVSGLangError(
                f"checkpoint: request {req.rid} has {protected} tokens protected by the tree but writes back "
                f"only {n} (up_to={up_to}); write back at least what it matched (up_to >= cache_protected_len)"
            )
        key = RadixKey(token_ids[:n], req.extra_key, cache_salt=req.cache_salt)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        try:
            result = self.insert(
                InsertParams(
                    key=key,
                    value=row[:n].to(torch.int64),
                    mamba_value=mamba_value,
                    prev_prefix_len=protected,
                    priority=req.priority or 0,
                )
            )
        except Exception:
            if mamba_value is not None and not finished:  # the copy made for this write-back
                self.req_to_token_pool.mamba_allocator.free(mamba_value)
            raise
        kv.cache_inserted_len = max(int(kv.cache_inserted_len), n)
        node = result.last_device_node
        new = self.path_device_indices(node)
        if new.numel() != n:
            raise HybridKVSGLangError(
                f"checkpoint: the insert ended on a node of {new.numel()} tokens for a key of {n} (plugin bug)"
            )
        self.req_to_token_pool.write((kv.req_pool_idx, slice(protected, n)), new[protected:])
        self.unlock(req.lock)
        req.lock = self.lock(node)
        kv.cache_protected_len = n
        req.last_node = node
        self._release_state(req, finished, mamba_value, inserted=not result.mamba_exist)
        if branch is not None and n >= branch:
            req.swa_branching_seqlen = None
            if not finished and _free_out_of_window():
                self._free_out_of_window(req, len(req.get_fill_ids()) - 1)

    def _free_out_of_window(self, req: Any, pre_len: int) -> None:
        """SGLang's own request-side SWA release (its cursor lives on the request)."""
        assert self._window is not None
        free_swa_out_of_window_slots(
            req,
            pre_len,
            sliding_window_size=self._window,
            page_size=self.page_size,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            retain_floor=self.swa_retain_floor(req),
        )

    def _release_state(self, req: Any, finished: bool, value: torch.Tensor | None, *, inserted: bool) -> None:
        """After a Mamba write-back: a finished request whose slot the tree did not keep frees it;
        an unfinished one frees the copy the tree did not keep and forgets its tracked lengths."""
        if not self.has_mamba or value is None:
            return
        if finished:
            if not inserted:
                self.req_to_token_pool.free_mamba_cache(req)
            return
        if not inserted:
            self.req_to_token_pool.mamba_allocator.free(value)
        req.kv.mamba_last_track_seqlen = None
        req.kv.mamba_prev_track_seqlen = None


def _free_out_of_window() -> bool:
    return bool(envs.SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS.get())
