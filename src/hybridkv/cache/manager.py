"""KVManager: a request's KV from admission to release, with allocation that evicts.

Above the prefix cache and the memory: the replay, the cache benchmark and an engine drive
every request through it. A request's life:

    match = kvm.match(tokens, ns)            # longest hit valid for every component
    h = kvm.admit(match, ns)                 # lock the hit; fork its checkpoint (or a fresh state slot)
    h = kvm.reserve(n, ns); kvm.received(h)  # or: memory for n tokens whose KV arrives by transfer
    kvm.extend(h, n)                         # grow to n tokens (batched: extend_batch)
    kvm.release_windows([h])                 # window pages that left each window: window-cached
    kvm.checkpoints.wanted(h, prompt_len)    # where the placement wants the state stored (chunk ends)
    kvm.checkpoints.take(h) / .reserve(h, at)   # a state checkpoint at a page-aligned length
                                             # (request_checkpoints.Checkpoints: every way to place one)
    kvm.checkpoints.at_finish(h)             # where the placement wants one at the sequence end
    kvm.insert(h, tokens)                    # cache what is computed, keep running (relocked)
    kvm.finish(h, tokens)  |  kvm.release(h) # cache and release  |  abort / retract (many: *_all)

Allocation with eviction (``alloc_pages`` / ``alloc_state`` / ``fork_state``, and every call
above that allocates): on ``OutOfMemory`` the cache evicts what the allocator says it is
short of and the call is retried; ``OutOfMemory`` reaches the caller only once nothing
unlocked and unpinned is left to evict for it: a pool whose own component has nothing left
(windows all tombstoned, no checkpoint) gets slab bytes from whole leaves, tree windows and
cached checkpoints. Before a refusal of a request's pages (``extend``, ``extend_batch``)
reaches the caller, the requests' own checkpoints are given up and it is tried again: those
not inserted yet are freed (counted in ``given_up_states``), and their locks stop holding
the cached checkpoint at their end (a running request runs on its own fork of it), so the
cache may evict it: a request that fits the budget alone never fails for its checkpoints.
Such a refusal leaves every handle as it was but for those checkpoints (the cache may have
evicted).

Window pages that leave a request's window become window-cached (``park_windows``, the
default): the cache holds their window cells, reclaimed first when memory is short; the
request's insert hands them to the tree node that covers them (a hit inside them stays
valid), its release frees them with its pages. With ``park_windows=False`` they are freed
at once (a manager whose requests never insert).

Invariants:
- Every page, slot and lock a handle holds is given back exactly once, by ``release``
  (``finish`` ends with it); duplicates an insert did not keep are freed by that insert.
- A refused call (``CacheError``) changes no handle, the tree or the pools; a refused
  allocation (``OutOfMemory``) changes no handle but for its given-up checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from hybridkv.cache.args import as_array, integer
from hybridkv.cache.errors import CacheError
from hybridkv.cache.handle import HandleStatus, KVHandle, checked_handle, checked_handles, fresh_pages
from hybridkv.cache.placement import DEFAULT, CheckpointPlacement
from hybridkv.cache.prefix_cache import HybridRadixCache, InsertResult, MatchResult
from hybridkv.cache.request_checkpoints import Checkpoints
from hybridkv.cache.rules import PAGE_NEED, Need
from hybridkv.memory import GateStatus, MoveGate, OutOfMemory
from hybridkv.memory.gates import DoneEvent
from hybridkv.spec import IdSpace

T = TypeVar("T")
_NO_PAGES = np.empty(0, dtype=np.int64)


class KVManager:
    def __init__(
        self, cache: HybridRadixCache, placement: CheckpointPlacement | str = DEFAULT, *, park_windows: bool = True
    ):
        """``placement``: where requests store state checkpoints (``placement.py``; a spec
        string or a parsed placement for this cache's page size). ``park_windows``: window pages
        that leave a window stay window-cached (False: freed at once, for a cache nothing is inserted into)."""
        if not isinstance(cache, HybridRadixCache):
            raise CacheError(f"KVManager: expected a HybridRadixCache, got {type(cache).__name__}")
        if not isinstance(park_windows, bool):
            raise CacheError(f"KVManager: park_windows must be a bool, got {type(park_windows).__name__}")
        self.cache = cache
        self.park_windows = park_windows
        self._window_cache = cache.residency.window_cache
        self.mem = cache.mem
        self.page_size = cache.page_size
        if isinstance(placement, str):
            placement = CheckpointPlacement.parse(placement, cache.page_size)
        if not isinstance(placement, CheckpointPlacement) or placement.page_size != cache.page_size:
            raise CacheError(
                f"KVManager: placement must be a spec string or a CheckpointPlacement for page size "
                f"{cache.page_size}, got {placement!r}"
            )
        self.placement = placement
        rules = cache.rules
        self._windows = tuple(w.pool_id for w in rules.windows)
        self._state_pool = rules.checkpoint.pool_id if rules.checkpoint is not None else None
        self.checkpoints = Checkpoints(self.mem, placement, self._state_pool, self.alloc_state, self.fork_state)

    @property
    def has_state(self) -> bool:
        return self._state_pool is not None

    @property
    def has_windows(self) -> bool:
        """Some pool releases history (``release_windows`` has work)."""
        return bool(self._windows)

    # --- allocation with eviction ---------------------------------------------------------

    def evict(self, needs: Mapping[Need, int]) -> dict[Need, int]:
        """The cache's eviction for a refused allocation (``HybridRadixCache.evict`` with
        ``for_slabs``: a pool short of what its own component frees gets slab bytes from
        whole leaves); the one place allocation calls it."""
        return self.cache.evict(needs, for_slabs=True)

    def alloc_pages(self, count: int) -> np.ndarray:
        """``mem.alloc_pages``, evicting what the allocator is short of until it fits."""
        count = integer(count, "alloc_pages count", minimum=0)
        return self._with_eviction(lambda: self.mem.alloc_pages(count), {PAGE_NEED: count})

    def alloc_state(self, count: int) -> np.ndarray:
        count = integer(count, "alloc_state count", minimum=0)
        return self._with_eviction(lambda: self.mem.alloc_state(count), self._slot_need(count))

    def fork_state(self, slots: list[int] | np.ndarray) -> np.ndarray:
        """New slots holding copies of ``slots``' states (copy-on-write of a checkpoint)."""
        src = as_array(slots)
        if src.ndim != 1 or (src.size and src.dtype.kind not in "iu"):
            raise CacheError(f"fork_state: slots must be a 1-D sequence of slot ids, got {slots!r}")
        return self._with_eviction(lambda: self.mem.fork_state(src), self._slot_need(src.size))

    def _slot_need(self, count: int) -> dict[Need, int]:
        if self._state_pool is None:
            raise CacheError(f"this shard ({self.mem.shard.describe()}) has no recurrent layers: no state slots")
        return {self._state_pool: count}

    def _with_eviction(self, call: Callable[[], T], fallback: dict[Need, int]) -> T:
        """``call()``; after each refusal, evict what it was short of and call again."""
        while True:
            try:
                return call()
            except OutOfMemory as exc:
                if not any(self.evict(self._needs(exc, fallback)).values()):
                    raise

    def _alloc_for(self, handles: list[KVHandle], count: int) -> np.ndarray:
        """``alloc_pages`` for ``handles``' growth; refused even after eviction, their own
        checkpoints are given up and it is tried once more."""
        try:
            return self.alloc_pages(count)
        except OutOfMemory as exc:
            if set(exc.short) == {IdSpace.PAGE} or not self._give_up_checkpoints(handles):
                raise  # short of page ids (no bytes help), or nothing to give up
        return self.alloc_pages(count)

    def _give_up_checkpoints(self, handles: list[KVHandle]) -> int:
        """Free the handles' unpinned checkpoints that no insert cached yet (an optimisation
        the request goes on without) and let go of the cached checkpoints their locks hold
        (evictable then); returns how many of either."""
        pins = self.mem.gates.slot_pins
        slots = []
        unlocked = 0
        for h in handles:
            for at, slot in list(h.checkpoints.items()):
                if not pins[slot]:
                    slots.append(slot)
                    del h.checkpoints[at]
            if h.lock.checkpoint_node is not None:
                self.cache.unlock_checkpoint(h.lock)
                unlocked += 1
        if slots:
            self.mem.free_state(np.asarray(slots, dtype=np.int64))
            self.cache.counters.given_up_checkpoints += len(slots)
        return len(slots) + unlocked

    def _needs(self, exc: OutOfMemory, fallback: dict[Need, int]) -> dict[Need, int]:
        """What to evict for a refused allocation: pools short of cells by pool id; virtual
        id spaces by the memory's own id-space objects (pages: whole pages; slots: the state
        pool); ``fallback`` when the allocator did not say."""
        needs: dict[Need, int] = {}
        for key, count in (exc.short or fallback).items():
            if key in self.mem.pools or key is PAGE_NEED:
                needs[key] = count
            elif key is IdSpace.SLOT and self._state_pool is not None:
                needs[self._state_pool] = count
            else:
                raise CacheError(
                    f"out of memory short of {key}, which is neither a pool id of this memory "
                    f"{sorted(map(str, self.mem.pools))} nor its page or slot ids (a memory/cache mismatch)"
                ) from exc
        return needs

    # --- a request's life -----------------------------------------------------------------

    def match(self, tokens: object, namespace: Hashable = None) -> MatchResult:
        return self.cache.match_prefix(tokens, namespace)

    def admit(self, match: MatchResult, namespace: Hashable = None) -> KVHandle:
        """Lock ``match`` for a new request; with recurrent layers, give it a running state
        slot: a fork of the hit's checkpoint (with no room for the copy even after eviction,
        the checkpoint itself, out of the cache), or a fresh slot when the hit has none (its
        state starts from zero). On ``OutOfMemory`` nothing is held."""
        if not isinstance(match, MatchResult):
            raise CacheError(f"admit: expected a MatchResult from match(), got {type(match).__name__}")
        lock = self.cache.lock(match.node)
        handle = KVHandle(namespace, match, lock, self.page_size, self._windows)
        if self._state_pool is not None:
            try:
                if match.checkpoint is not None:
                    handle.state_slot = int(self.fork_state([match.checkpoint])[0])
                else:
                    handle.state_slot = int(self.alloc_state(1)[0])
            except OutOfMemory:
                slot = self.cache.take_checkpoint(lock) if match.checkpoint is not None else None
                if slot is None:
                    self.cache.unlock(lock)
                    handle.status = HandleStatus.RELEASED
                    raise
                handle.state_slot = slot
        return handle

    def reserve(self, seq_len: int, namespace: Hashable = None) -> KVHandle:
        """A RECEIVING handle holding the pages (and, with recurrent layers, a state slot) that
        ``seq_len`` tokens need, for KV and state that arrive by transfer: nothing reads, matches,
        grows or evicts it until ``received``; ``release`` frees it (a transfer that failed). On
        ``OutOfMemory`` (after eviction) nothing is held."""
        seq_len = integer(seq_len, "reserve seq_len", minimum=1)
        match = self.match(np.empty(0, dtype=np.int64), namespace)
        handle = KVHandle(namespace, match, self.cache.lock(match.node), self.page_size, self._windows)
        try:
            handle.grow(seq_len, self.alloc_pages(handle.pages_needed(seq_len)))
            if self._state_pool is not None:
                handle.adopt_state(int(self.alloc_state(1)[0]))
        except OutOfMemory:
            self.release(handle)
            raise
        handle.status = HandleStatus.RECEIVING
        return handle

    def received(self, handle: KVHandle) -> None:
        """The KV and state of a ``reserve``d handle arrived: it runs from its ``seq_len`` on."""
        handle = checked_handle(handle, "received")
        if handle.status is not HandleStatus.RECEIVING:
            raise CacheError(f"received: the request is {handle.status.value}, not receiving")
        handle.status = HandleStatus.RUNNING

    def extend(self, handle: KVHandle, new_len: int) -> np.ndarray:
        """Grow ``handle`` to ``new_len`` tokens; returns the fresh pages (maybe none)."""
        handle = checked_handle(handle, "extend")
        new_len = integer(new_len, "extend new_len")
        if handle.status is not HandleStatus.RUNNING:
            handle.check_running("extend")
        if new_len < handle.seq_len:
            raise CacheError(f"extend: a request of {handle.seq_len} tokens cannot shrink to {new_len}")
        before = handle.n_pages
        handle.grow(new_len, self._alloc_for([handle], handle.pages_needed(new_len)))
        return handle.pages[before:]

    def extend_batch(self, handles: Sequence[KVHandle], new_lens: Sequence[int]) -> None:
        """Grow every handle to its new length with one allocation (a decode batch)."""
        handles = checked_handles(handles, "extend_batch")
        if not isinstance(new_lens, Sequence) or len(new_lens) != len(handles):
            raise CacheError(f"extend_batch: need one new length per handle ({len(handles)}), got {new_lens!r}")
        if not all(type(n) is int for n in new_lens):
            new_lens = [integer(n, "extend_batch new_lens") for n in new_lens]
        needs = []
        running, ps = HandleStatus.RUNNING, self.page_size
        for h, n in zip(handles, new_lens, strict=True):
            if h.status is not running:
                h.check_running("extend")
            if n < h.seq_len:
                raise CacheError(f"extend: a request of {h.seq_len} tokens cannot shrink to {n}")
            needs.append(fresh_pages(n, h.n_pages, ps))
        total = sum(needs)
        KVHandle.grow_all(handles, new_lens, self._alloc_for(handles, total) if total else _NO_PAGES)

    def release_windows(self, handles: Sequence[KVHandle]) -> int:
        """Release the own pages that left each window pool's window, batched per pool: the
        cache holds their window cells (window-cached) or, without ``park_windows``, they are
        freed there; returns how many pages left a pool."""
        handles = checked_handles(handles, "release_windows")
        if not self._windows or not handles:
            return 0
        n, ps = len(handles), self.page_size
        seq = np.fromiter((h.seq_len for h in handles), dtype=np.int64, count=n)
        cached = np.fromiter((h.cached for h in handles), dtype=np.int64, count=n)
        leaving = np.zeros(n, dtype=bool)
        for i, pool_id in enumerate(self._windows):  # only handles with pages past a window's start release any
            released = np.fromiter((h.released[i] for h in handles), dtype=np.int64, count=n)
            leaving |= pool_id.first_needed(seq) // ps > np.maximum(released, cached)
        moved = [handles[i] for i in np.flatnonzero(leaving).tolist()]
        if not moved:
            return 0
        per_pool = zip(*(h.window_release() for h in moved), strict=True)
        freed = 0
        for w, parts in zip(self.cache.rules.windows, per_pool, strict=True):
            left = [p for p in parts if p.size]
            if left:
                pages = np.concatenate(left) if len(left) > 1 else left[0]
                if self.park_windows:
                    self._window_cache.hold(pages, w)
                else:
                    self.mem.windows.free(pages, w.pool_id)
                freed += int(pages.size)
        return freed

    def discard_windows(self, handle: KVHandle) -> int:
        """Free at once (never window-cache) each window pool's cells of the own pages before
        its window at ``seq_len``: cells that hold no computed bytes (pages restored from a tier
        below, which brings back only the window before the restored end; cached, such a cell
        would make a later hit inside that span read garbage). Returns how many were freed."""
        handle = checked_handle(handle, "discard_windows")
        handle.check_running("discard_windows")
        freed = 0
        for i, pool in enumerate(handle.windows):
            first = pool.page_span(handle.seq_len, self.page_size)[0]
            lo = max(handle.released[i], handle.cached)
            if first > lo:
                pages = handle.pages[lo:first]  # never window-cached: released marks what was
                self.mem.windows.free(pages, pool)
                handle.released[i] = first
                freed += int(pages.size)
        return freed

    def insert(self, handle: KVHandle, tokens: object, *, final: bool = False) -> InsertResult:
        """Cache the page-aligned part of ``tokens`` (the sequence so far) with the handle's
        pages and its checkpoints up to there; free what the cache did not keep. Not
        ``final``: the handle keeps running on the cache's ids, relocked at the new end.
        ``final``: the handle is COMMITTED (only ``release`` is left)."""
        handle = checked_handle(handle, "insert")
        if handle.status is not HandleStatus.RUNNING:
            handle.check_running("insert")
        toks = tokens if type(tokens) is np.ndarray else as_array(tokens)
        size = toks.size
        if toks.ndim != 1 or (size and toks.dtype.kind not in "iu"):
            raise CacheError(f"insert: tokens must be a 1-D integer array, got shape {toks.shape} {toks.dtype}")
        if size > handle.seq_len:
            raise CacheError(
                f"insert: {size} tokens of shape {toks.shape}, but the request holds KV of "
                f"{handle.seq_len} tokens; pass its 1-D sequence so far"
            )
        ps = self.page_size
        n = size // ps
        if n < handle.cached:
            raise CacheError(
                f"insert: {size} tokens cover {n} pages, fewer than the {handle.cached} pages "
                "already cached for this request"
            )
        end = n * ps
        ckpts = {p: s for p, s in handle.checkpoints.items() if p <= end} if handle.checkpoints else None
        result = self.cache.insert(toks[:end], handle.pages[:n], extra_key=handle.namespace, checkpoints=ckpts)
        if self._window_cache.total:  # the tree holds the inserted pages' window cells now; duplicates go
            self._window_cache.drop(handle.pages[handle.cached : n])
        for p in ckpts or ():
            del handle.checkpoints[p]
        if result.duplicates.size:
            self.mem.free_pages(result.duplicates)
        if result.unused_checkpoints:
            self.mem.free_state(np.asarray(result.unused_checkpoints, dtype=np.int64))
        if final:
            handle.commit(result.pages)
        else:  # the new lock first: the hit is never unprotected
            self.cache.unlock(handle.settle(result.pages, self.cache.lock(result.node)))
        return result

    def finish(self, handle: KVHandle, tokens: object) -> InsertResult:
        """Cache the finished sequence, then release the request."""
        return self.finish_all([handle], [tokens])[0]

    def finish_all(self, handles: Sequence[KVHandle], tokens: Sequence[object]) -> list[InsertResult]:
        """``finish`` of every handle (``tokens[i]``: its sequence): each cached, then all released at once."""
        handles = checked_handles(handles, "finish_all")
        if len(tokens) != len(handles):
            raise CacheError(f"finish_all: need one token sequence per handle ({len(handles)}), got {len(tokens)}")
        results = [self.insert(h, t, final=True) for h, t in zip(handles, tokens, strict=True)]
        self.release_all(handles)
        return results

    def release(self, handle: KVHandle) -> None:
        """Give back everything the request holds that the cache does not: its own pages,
        its state slot and checkpoints, its lock (abort, retract, or the end of ``finish``)."""
        self.release_all([handle])

    def release_all(self, handles: Sequence[KVHandle]) -> None:
        """``release`` of every handle (distinct), their pages freed with one call and their slots with one: all
        released, or (a handle released already, or pinned) none."""
        handles = checked_handles(handles, "release")
        if not handles:
            return
        if len({id(h) for h in handles}) != len(handles):
            raise CacheError("release: a request appears twice")
        slots: list[int] = []
        for handle in handles:
            if handle.status is HandleStatus.RELEASED:
                raise CacheError("release: this request was released already")
            if handle.gates and any(g.status is not GateStatus.RELEASED for g in handle.gates):
                raise CacheError("release: the request still pins its ids (a forward or transfer); unpin it first")
            if handle.checkpoints:
                slots += handle.checkpoints.values()
            if handle.state_slot is not None:
                slots.append(handle.state_slot)
        rows = [h.own_pages() for h in handles]
        own = rows[0] if len(rows) == 1 else np.concatenate(rows)
        gates = self.mem.gates
        if gates.pinning_gates and (
            np.count_nonzero(gates.page_pins[own]) or (slots and np.count_nonzero(gates.slot_pins[slots]))
        ):
            raise CacheError("release: a page or slot of the request is pinned by another move gate; release it first")
        if own.size:
            if self._window_cache.total:
                self._window_cache.drop(own)
            self.mem.free_pages(own)
        if slots:
            self.mem.free_state(np.asarray(slots, dtype=np.int64))
        for handle in handles:
            self.cache.unlock(handle.lock)
            handle.checkpoints.clear()
            handle.state_slot = None
            handle.gates.clear()
            handle.status = HandleStatus.RELEASED

    # --- pins -----------------------------------------------------------------------------

    def pin(self, handle: KVHandle, event: DoneEvent | None = None) -> MoveGate:
        """Pin the request's pages and slots while a forward or transfer reads them (until
        ``unpin``, or until ``event`` completes)."""
        handle = checked_handle(handle, "pin")
        handle.check_running("pin")
        slots = [*([handle.state_slot] if handle.state_slot is not None else []), *handle.checkpoints.values()]
        gate = self.mem.pin(pages=handle.pages, slots=slots, event=event)
        handle.gates.append(gate)
        return gate

    def unpin(self, handle: KVHandle) -> None:
        handle = checked_handle(handle, "unpin")
        for gate in handle.gates:
            gate.release()
        handle.gates.clear()
