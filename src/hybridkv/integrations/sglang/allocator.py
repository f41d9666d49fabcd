"""A full-attention token-to-KV allocator for SGLang 0.5.23 whose free list is a ``UnifiedMemory``.

``HybridKVTokenToKVPoolAllocator`` answers SGLang's ``BaseTokenToKVPoolAllocator`` contract (what the
scheduler and the radix caches call: ``alloc``, ``alloc_extend``, ``alloc_decode``, ``free``,
``free_segment(s)``, ``free_page_ids``, ``free_group_begin/end``, ``available_size``, ``clear``,
``resize``, ``get_all_free_pages``, ``get_kvcache``, ``size``, ``page_size``, ``dtype``, ``device``) in
place of SGLang's ``TokenToKVPoolAllocator`` (page size 1) and ``PagedTokenToKVPoolAllocator``. Its ids
are virtual pages of a private ``UnifiedMemory`` (one full-attention pool, page size SGLang's): a
location is ``page * page_size + offset``, the memory's sink page 0 is SGLang's padding page 0, and the
memory holds exactly SGLang's ``size // page_size`` pages (surplus page ids that the slab rounding
creates are allocated once at construction and never handed out). ``alloc``, ``free``, ``free_segment``
go through ``TokenAllocator`` (``tokens.py``); ``alloc_extend`` / ``alloc_decode`` take fresh pages
from the page API and compose the continuation of a partial page on the device (SGLang passes
``last_loc`` on the device; ``TokenAllocator``'s versions take host locations).

The bytes stay in SGLang's KV pool (``kvcache``, indexed by these locations); the memory's own cells
are a 4-byte-per-token shadow. ``register_allocator_hook`` installs it (opt-in, see ``ENV``).

Invariants (the parity replay checks each after every step, with ``mem.verify()``):
- Every location SGLang holds lies on a live page of the memory, in ``[page_size, (pages + 1) *
  page_size)`` (inside SGLang's KV buffers); a page is handed out once until it is freed.
- ``available_size() == mem.available_pages() * page_size`` and equals the free pages x page size
  (``mem.pages.free_count``): the memory has no fragmentation loss (one slab holds whole pages).
- A call refused by the memory (out of pages) returns ``None`` as SGLang's do, with nothing changed.
- Frees are refused, never silently doubled: freeing a page that is not live (a double free, an id
  out of range, the padding page) raises ``HybridKVAllocatorError`` and frees nothing; SGLang's
  allocators do not check it (page size 1 lists the location twice; paged puts the page twice on
  its free list). In a free group, the group's ``free`` calls are deduplicated per page together
  (as SGLang's ``torch.unique`` at ``free_group_end``); a page freed by two different kinds of call
  of one group (``free`` and ``free_segment``) is a double free, refused at the group's end with
  nothing freed.

Host reads of device tensors (none in allocation):
- ``alloc`` / ``alloc_extend`` / ``alloc_decode`` read nothing from the device: page counts come from
  ``prefix_lens_cpu`` / ``seq_lens_cpu``; fresh locations go host -> device; a continuation is
  ``last_loc + 1 + i`` computed on the device. ``last_loc`` is therefore trusted, as SGLang's
  allocators trust it (their debug mode checks it; this one does not).
- ``free`` / ``free_segment`` / ``free_page_ids`` read the freed ids once (``.cpu()``), because the
  memory's free list and liveness tables are host tables; inside a free group the ids are kept as
  device tensors and read in one copy at ``free_group_end``. (SGLang's paged ``free`` also waits on the
  device, in ``torch.unique``.)
- ``get_all_free_pages`` (the scheduler's leak census) reads host tables and copies them to the device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

from hybridkv.memory import UnifiedMemory
from hybridkv.memory.errors import MemoryPoolError
from hybridkv.memory.sizing import MemoryHints, plan_memory
from hybridkv.memory.tokens import TokenAllocator
from hybridkv.spec import FullAttention, ModelSpec, ShardSpec

logger = logging.getLogger(__name__)

ENV = "HYBRIDKV_SGLANG_ALLOCATOR"
"""``1`` turns the allocator on (``register()`` then installs the hook); unset or ``0``: SGLang's own."""

HOOK_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool_allocator"

_SHADOW_TOKEN_BYTES = 4  # one fp16 K and one fp16 V element per token: the memory's ids, not SGLang's bytes


class HybridKVAllocatorError(ValueError):
    """A call this allocator refuses; the message names what SGLang's allocator would do and what to change."""


def token_memory(pages: int, page_size: int) -> UnifiedMemory:
    """A ``UnifiedMemory`` with exactly ``pages`` allocatable page ids (1..pages) of ``page_size`` tokens.

    One slab holds ``group`` whole cells and the arena whole slabs, so free cells and free pages never
    diverge; the slab rounding's surplus ids (above ``pages``) are allocated here and kept.
    """
    if page_size < 1 or pages < 1:
        raise HybridKVAllocatorError(f"token memory: page_size {page_size} and pages {pages} must be >= 1")
    group = max(1, min(1024, pages // 256))
    slabs = -(-pages // group)
    cell = _SHADOW_TOKEN_BYTES * page_size
    spec = ModelSpec.from_kinds(
        "sglang-token-ids", [FullAttention(1, 1, 1)], kv_dtype=torch.float16, max_context=pages * page_size
    )
    hints = MemoryHints(
        page_size=page_size,
        max_context=min(pages * page_size, 1 << 16),
        chunk_tokens=min(pages * page_size, 1 << 12),
        slab_bytes=cell * group,
    )
    mem = UnifiedMemory(plan_memory(ShardSpec.whole(spec), cell + cell * group * slabs, hints), "cpu")
    everything = mem.alloc_pages(mem.pages.capacity - 1)  # ids 1..capacity-1, lowest first
    mem.free_pages(everything[everything <= pages])
    if mem.available_pages() != pages:
        raise AssertionError(f"token memory: {mem.available_pages()} pages allocatable, SGLang's pool {pages}")
    return mem


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class HybridKVTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """SGLang's full-attention token-to-KV allocator, its free list a ``UnifiedMemory``'s pages."""

    free_group: list[torch.Tensor] | None

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: Any,
        need_sort: bool = False,
    ):
        if type(page_size) is not int or page_size < 1:
            raise HybridKVAllocatorError(f"page_size must be an int >= 1, got {page_size!r}")
        if type(size) is not int or size < page_size:
            raise HybridKVAllocatorError(
                f"size {size!r} tokens: SGLang's allocators take the token count (an int >= page_size "
                f"{page_size}); pass sizes.max_total_num_tokens"
            )
        if not isinstance(dtype, torch.dtype):
            raise HybridKVAllocatorError(f"dtype must be a torch.dtype (the KV cache's), got {dtype!r}")
        torch.device(device)  # refuses a malformed device string
        if kvcache is not None:
            kv_dtype = getattr(kvcache, "dtype", dtype)
            kv_size = getattr(kvcache, "size", size)
            kv_ps = getattr(kvcache, "page_size", page_size)
            if kv_dtype != dtype or kv_ps != page_size or kv_size < size:
                raise HybridKVAllocatorError(
                    f"the KV pool {type(kvcache).__name__} (dtype {kv_dtype}, page_size {kv_ps}, size {kv_size}) "
                    f"does not hold this allocator's locations (dtype {dtype}, page_size {page_size}, size {size}); "
                    "build both from the same sizes, as SGLang's configurator does"
                )
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        self._device = torch.device(device)
        self.num_pages = size // page_size
        self._build()

    def _build(self) -> None:
        self.mem = token_memory(self.num_pages, self.page_size)
        self.tokens = TokenAllocator(self.mem)
        self.free_group = None
        self._group_segments: list[tuple[torch.Tensor, int]] = []
        self._group_pages: list[torch.Tensor] = []

    # --- capacity ------------------------------------------------------------------------------

    def available_size(self) -> int:
        return self.mem.available_pages() * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        """Free page ids (for page size 1, free locations), host tables copied to the device."""
        free = np.flatnonzero(~self.mem.pages.live[: self.num_pages + 1])
        return torch.from_numpy(free).to(self._device)

    def merge_and_sort_free(self) -> None:
        """Nothing to merge: the memory's free list has no staged part."""

    # --- allocation ----------------------------------------------------------------------------

    def _out(self, host: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64)).to(self._device)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        ps = self.page_size
        if type(need_size) is not int or need_size < 0:
            raise HybridKVAllocatorError(f"alloc: need_size must be an int >= 0, got {need_size!r}")
        if need_size % ps:
            raise HybridKVAllocatorError(
                f"alloc({need_size}) with page_size {ps}: SGLang's PagedTokenToKVPoolAllocator would silently "
                f"hand out {need_size // ps * ps} locations (whole pages, rounded down); hybridkv refuses. "
                f"Ask for a multiple of {ps} or use alloc_extend"
            )
        if not self.mem.pages_fit(need_size // ps):
            return None
        return self._out(self.tokens.alloc(need_size))

    def _lengths(self, what: str, named: dict[str, torch.Tensor], device_args: dict[str, torch.Tensor]) -> list[Any]:
        """Host lengths from the ``*_cpu`` tensors; device arguments checked by metadata only (no read)."""
        out = []
        bs = None
        for name, t in {**named, **device_args}.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
                raise HybridKVAllocatorError(
                    f"{what}: {name} must be a 1-D int64/int32 tensor as SGLang's scheduler passes, got "
                    f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}"
                )
            if bs is None:
                bs = t.numel()
            elif t.numel() != bs:
                raise HybridKVAllocatorError(f"{what}: {name} has {t.numel()} entries, the batch {bs}")
        for name, t in named.items():
            if t.device.type != "cpu":
                raise HybridKVAllocatorError(f"{what}: {name} must be the host copy, got a {t.device} tensor")
            out.append(t.numpy().astype(np.int64, copy=False))
        for name, t in device_args.items():
            if not _same_device(t.device, self._device):
                raise HybridKVAllocatorError(
                    f"{what}: {name} is on {t.device}, the allocator on {self._device} (SGLang's allocator "
                    "indexes its free pages with it on its own device); pass it on the allocator's device"
                )
        return out

    def _paged_only(self, what: str) -> None:
        if self.page_size == 1:
            raise NotImplementedError(
                f"{what} is only for paged allocators (page_size > 1), as in SGLang's TokenToKVPoolAllocator; "
                "at page size 1 the scheduler calls alloc"
            )

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        """Request ``i`` grows from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens: first the rest of its
        last page (``last_loc[i] + 1, ...``, on the device), then fresh pages; request after request."""
        self._paged_only("alloc_extend")
        ps = self.page_size
        prefix, seq = self._lengths(
            "alloc_extend",
            {"prefix_lens_cpu": prefix_lens_cpu, "seq_lens_cpu": seq_lens_cpu},
            {"prefix_lens": prefix_lens, "seq_lens": seq_lens, "last_loc": last_loc},
        )
        if prefix.size and ((prefix < 0).any() or (seq < prefix).any()):
            i = int(np.argmax((prefix < 0) | (seq < prefix)))
            raise HybridKVAllocatorError(
                f"alloc_extend: request {i} has prefix_len {prefix[i]} > seq_len {seq[i]} (or < 0)"
            )
        counts = seq - prefix
        if int(counts.sum()) != extend_num_tokens:
            raise HybridKVAllocatorError(
                f"alloc_extend: extend_num_tokens {extend_num_tokens} but the lengths add up to {int(counts.sum())}; "
                "SGLang's allocator would return that many locations, some of them garbage"
            )
        old_pages = -(-prefix // ps)
        new_per = -(-seq // ps) - old_pages
        need = int(new_per.sum())
        if num_new_pages is not None and num_new_pages != need:
            raise HybridKVAllocatorError(f"alloc_extend: num_new_pages {num_new_pages}, the lengths need {need}")
        if not self.mem.pages_fit(need):
            return None
        pages = self.mem.alloc_pages(need)
        req = np.repeat(np.arange(seq.size), counts)
        local = np.arange(req.size) - (np.cumsum(counts) - counts)[req]
        pos = prefix[req] + local
        page_index = pos // ps - old_pages[req]
        fresh = page_index >= 0
        out = np.zeros(req.size, dtype=np.int64)
        first_new = np.cumsum(new_per) - new_per
        out[fresh] = pages[first_new[req[fresh]] + page_index[fresh]] * ps + pos[fresh] % ps
        dev = self._out(out)
        if fresh.all():
            return dev
        # the rest of the request's last page: last_loc + 1 + local, never read on the host
        owner = self._out(req)
        step = self._out(local + 1)
        return torch.where(self._out(fresh.astype(np.int64)).bool(), dev, last_loc.to(torch.int64)[owner] + step)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """One token per request (``seq_lens`` include it): a fresh page where it starts one, else
        ``last_loc + 1`` (on the device)."""
        self._paged_only("alloc_decode")
        ps = self.page_size
        (seq,) = self._lengths(
            "alloc_decode", {"seq_lens_cpu": seq_lens_cpu}, {"seq_lens": seq_lens, "last_loc": last_loc}
        )
        if seq.size and seq.min() < 1:
            raise HybridKVAllocatorError("alloc_decode: every seq_len must be >= 1 (it includes the new token)")
        new_page = (seq - 1) % ps == 0
        need = int(np.count_nonzero(new_page))
        if not self.mem.pages_fit(need):
            return None
        fresh = np.zeros(seq.size, dtype=np.int64)
        fresh[new_page] = self.mem.alloc_pages(need) * ps
        return torch.where(self._out(new_page.astype(np.int64)).bool(), self._out(fresh), last_loc.to(torch.int64) + 1)

    # --- release -------------------------------------------------------------------------------

    def _host(self, ids: torch.Tensor, what: str) -> np.ndarray:
        """The one host read of a free: the ids, as int64."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise HybridKVAllocatorError(
                f"{what}: pass an int64/int32 tensor of locations as SGLang does, got {type(ids).__name__} "
                f"{getattr(ids, 'dtype', '')}"
            )
        if not _same_device(ids.device, self._device):
            raise HybridKVAllocatorError(f"{what}: ids on {ids.device}, the allocator on {self._device}")
        return ids.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)

    def _refused(self, what: str, err: MemoryPoolError) -> HybridKVAllocatorError:
        return HybridKVAllocatorError(
            f"{what}: hybridkv refuses it, nothing freed: {err}. SGLang's {self._sglang_name()} does not check "
            "this and would put the page on its free list twice (a later alloc hands it to two requests); "
            "free each location once"
        )

    def _release(self, what: str, ids: torch.Tensor, release: Callable[[np.ndarray], object]) -> None:
        """``release`` the ids (read to the host once) now; a refusal raised as ``_refused``: nothing freed."""
        host = self._host(ids, what)
        try:
            release(host)
        except MemoryPoolError as err:
            raise self._refused(what, err) from None

    def _sglang_name(self) -> str:
        return "TokenToKVPoolAllocator" if self.page_size == 1 else "PagedTokenToKVPoolAllocator"

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages that hold these locations (any tokens of them)."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._copy_for_free_group(free_index))
            return
        self._release("free", free_index, self.tokens.free)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free ``row[start_pos : start_pos + n]`` of one request (``start_pos`` page-aligned)."""
        if start_pos % self.page_size:
            raise HybridKVAllocatorError(
                f"free_segment: start_pos {start_pos} is not page-aligned (page_size {self.page_size}); SGLang "
                "asserts the same"
            )
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self._group_segments.append((self._copy_for_free_group(free_index), start_pos))
            return
        self._release("free_segment", free_index, lambda host: self.tokens.free_segment(host, start_pos))

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages (no page twice)."""
        if page_ids.numel() == 0:
            return
        if self.free_group is not None:
            self._group_pages.append(self._copy_for_free_group(page_ids))
            return
        self._release("free_page_ids", page_ids, self.mem.free_pages)

    def free_group_begin(self) -> None:
        if self.free_group is not None:
            raise HybridKVAllocatorError("free_group_begin: a free group is open (SGLang asserts: no nesting)")
        self.free_group = []
        self._group_segments = []
        self._group_pages = []

    def free_group_end(self) -> None:
        """Release the group: ids read in one copy, checked together, released together or not at all."""
        frees: list[torch.Tensor] = self.free_group or []
        segments, pages = self._group_segments, self._group_pages
        self.free_group, self._group_segments, self._group_pages = None, [], []
        parts = [*frees, *(s for s, _ in segments), *pages]
        if not parts:
            return
        host = self._host(torch.cat([p.reshape(-1).to(torch.int64) for p in parts]), "free_group_end")
        cuts = np.cumsum([p.numel() for p in parts])[:-1]
        chunks = np.split(host, cuts)
        n_free, n_seg = len(frees), len(segments)
        try:
            with self.mem.free_group():
                if n_free:
                    self.tokens.free(np.concatenate(chunks[:n_free]))
                for (_, start), chunk in zip(segments, chunks[n_free : n_free + n_seg], strict=True):
                    self.tokens.free_segment(chunk, start)
                for chunk in chunks[n_free + n_seg :]:
                    self.mem.free_pages(chunk)
        except MemoryPoolError as err:
            raise self._refused("free_group_end", err) from None

    def clear(self) -> None:
        """Every page free again (the surplus ids stay kept)."""
        if not hasattr(self, "mem"):
            return
        live = np.flatnonzero(self.mem.pages.live[1 : self.num_pages + 1]) + 1
        if live.size:
            self.mem.free_pages(live)
        self.free_group, self._group_segments, self._group_pages = None, [], []

    def resize(self, config: Any) -> None:
        """A new token count: a new memory of that many pages (everything free), as SGLang's resize clears."""
        size = config.max_total_num_tokens
        if type(size) is not int or size < self.page_size:
            raise HybridKVAllocatorError(f"resize: max_total_num_tokens {size!r} must be an int >= {self.page_size}")
        self.size = size
        self.num_pages = size // self.page_size
        self._build()

    # --- KV copies: SGLang's pool owns the bytes ------------------------------------------------

    def get_cpu_copy(self, indices: Any, mamba_indices: Any = None, req_pool_index: Any = None) -> Any:
        return self._kvcache.get_cpu_copy(indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index)

    def load_cpu_copy(
        self, kv_cache_cpu: Any, indices: Any, mamba_indices: Any = None, req_pool_index: Any = None
    ) -> Any:
        return self._kvcache.load_cpu_copy(
            kv_cache_cpu, indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index
        )


# --- the hook ------------------------------------------------------------------------------------


def allocator_enabled() -> bool:
    """``HYBRIDKV_SGLANG_ALLOCATOR``: ``1`` on; unset, empty or ``0`` off; anything else refused."""
    value = os.environ.get(ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise HybridKVAllocatorError(f"{ENV}={value!r}: set it to 1 (hybridkv's token allocator) or 0 / unset (SGLang's)")


def build_allocator_around(original: Any, *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook on ``KVCacheConfigurator._build_token_to_kv_pool_allocator``.

    SGLang's builder picks the allocator class (NPU, DeepSeek V4, SWA, HiSparse, page interleave,
    decode context parallel, draft workers); this runs it and swaps in hybridkv's allocator only where
    it picked exactly ``TokenToKVPoolAllocator`` or ``PagedTokenToKVPoolAllocator`` for a target worker
    with a plain ``ReqToTokenPool`` (no Mamba), with the same size, page size, dtype, device, KV pool
    and ``need_sort``. Everything else is SGLang's, logged once.
    """
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    built = original(*args, **kwargs)
    served = type(built) in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator)
    target = kwargs.get("token_to_kv_pool_allocator") is None
    plain = type(kwargs.get("req_to_token_pool")) is ReqToTokenPool
    if not (served and target and plain):
        logger.warning(
            "%s=1: keeping SGLang's %s (hybridkv's token allocator serves full attention only: %s)",
            ENV,
            type(built).__name__,
            "a draft worker" if not target else "a Mamba request pool" if not plain else "another allocator class",
        )
        return built
    return HybridKVTokenToKVPoolAllocator(
        built.size, built.page_size, built.dtype, built.device, built.get_kvcache(), built.need_sort
    )


def register_allocator_hook() -> bool:
    """Register the hook when ``HYBRIDKV_SGLANG_ALLOCATOR=1`` (once per process); return whether it is on.

    AROUND, not REPLACE: SGLang's builder still runs for every configuration this allocator does not
    serve (a REPLACE would have to copy its class selection); where it serves, SGLang's choice is
    replaced. ``load_plugins`` runs ``register`` before ``HookRegistry.apply_hooks``.
    """
    if not allocator_enabled():
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(hook is build_allocator_around for _, hook, _ in HookRegistry._hooks.get(HOOK_TARGET, [])):
        HookRegistry.register(HOOK_TARGET, build_allocator_around, HookType.AROUND)
    return True
