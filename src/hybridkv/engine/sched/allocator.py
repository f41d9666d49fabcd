"""RequestAllocator: the one object that allocates memory for requests and frees it, through the prefix cache.

Every request's KV lives in a ``KVHandle`` of a ``KVManager`` above a ``HybridRadixCache``:
``admit`` matches the request's known tokens (in its namespace, an optional cache salt) and
admits the hit (its pages locked, its checkpoint forked into the request's own state slot,
or a fresh slot), so computation starts at the hit's end; ``extend`` grows every request of a
step with one allocation (the cache evicts what it is short of); ``mark_computed`` releases
the window pages that left every window (window-cached: kept for hits until memory is
needed); ``chunk_done`` stores a state checkpoint where the
manager's checkpoint placement wants one (``RequestMemory.wanted``, from
``KVManager.checkpoints.wanted`` at admission: the scheduler ends prefill chunks there) and
inserts the computed pages; ``finish`` caches the finished sequence (with a checkpoint at
its end when the placement wants one there and the end is page-aligned) and releases the
rest; ``retract`` releases (what was inserted stays cached). With ``prefix_cache=False``
nothing is matched or inserted: the same path, without hits.

With tiers below the device (``EngineTiers``: host memory, the Mooncake Store), ``new`` plans
a request's hit across them and starts the store's reads while it waits; ``admit`` re-plans
when the device hit moved, agrees on the restored length with the other ranks
(``EngineTiers.agreed``), reserves the pages up to it and copies the pieces in
(``EngineTiers.restore``): computation starts at the restored end, or at the device hit when
an object was missing on any rank (a miss with a reason, never garbage).

A disaggregated decode engine ``reserve``s a request's memory (a RECEIVING handle of the
manager) while its KV and state arrive by transfer and calls ``received`` once they landed;
a reservation that will not run is released by ``retract`` like any other: one owner, one free
path. Decisions that depend on a rank's memory (the hit length, the admission) go through an
``Agreement`` so that every rank of a multi-process engine decides alike.

Invariants:
- A request holds memory exactly while it has a handle; ``extend`` either grows every
  request of the step to its length or changes no handle (``OutOfMemory``).
- ``handle.seq_len`` equals the request's computed tokens after each forward; its state
  slot holds the state after them (``fresh``: zero it before the next forward).
- Checkpoints sit only at the placement's page-aligned positions past the cached part;
  every free goes through the manager's sync-free paths (``free_pages`` / ``windows.free`` / ``free_state``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from hybridkv.cache import PAGE_NEED, CheckpointPlacement, HybridRadixCache, KVHandle, KVManager, MatchResult
from hybridkv.cache.handle import fresh_pages
from hybridkv.cache.placement import DEFAULT
from hybridkv.engine.sched.agreement import ALONE, Agreement
from hybridkv.engine.sched.tiered import EngineTiers
from hybridkv.memory import OutOfMemory, UnifiedMemory
from hybridkv.spec import KindTag
from hybridkv.tiers import Fetched

_NO_TOKENS = np.empty(0, dtype=np.int64)


class Admission(Enum):
    """What ``admit`` decided; ordered so that the minimum over ranks is the decision of all."""

    TOO_BIG = 0  # not even its state slot fits with nothing else held: it fails alone
    REFUSED = 1  # not now: it waits
    ADMITTED = 2


@dataclass(frozen=True)
class CacheHit:
    """What a request's first admission found in the cache (tokens of the match per component)."""

    cached_tokens: int
    """Tokens valid for every component: prefill started there."""
    full: int
    """Page-aligned full-KV match."""
    window: int
    """Longest match valid for full KV and every window pool."""
    checkpoint: int
    """Deepest state checkpoint on the full-KV match (0 without recurrent layers)."""
    host: int = 0
    """Tokens of ``cached_tokens`` whose full KV came back from host memory (restored at admission)."""
    storage: int = 0
    """Tokens of ``cached_tokens`` whose full KV came back from the store (the Mooncake Store)."""

    @classmethod
    def of(cls, m: MatchResult, details: dict[str, int] | None = None) -> CacheHit:
        """The device ``m``'s hit; with ``details`` (``EngineTiers.details``) a hit restored
        beyond it from the tiers below."""
        if details is None:
            return cls(m.length, m.full_length, m.window_length, m.checkpoint_length)
        total = sum(details.values())
        return cls(total, m.full_length, m.window_length, m.checkpoint_length, details["host"], details["storage"])

    @property
    def details(self) -> dict[str, int]:
        """``cached_tokens`` by where their full KV came from (the server's ``cached_tokens_details``)."""
        return {"device": self.cached_tokens - self.host - self.storage, "host": self.host, "storage": self.storage}


@dataclass
class RequestMemory:
    namespace: Hashable = None
    handle: KVHandle | None = None
    fresh: bool = True
    wanted: tuple[int, ...] = ()
    """Page-aligned positions where a prefill chunk must end: the placement wants a checkpoint there."""
    hit: CacheHit | None = None
    """The first admission's hit (kept across retractions)."""
    cached_tokens: int = 0
    """Tokens taken from the cache over every admission."""
    fetched: Fetched | None = None
    """With tiers: the cross-tier hit planned while it waits (store reads under way)."""
    reuse: bool = True
    """It may start from a prefix-cache hit (False: it computes its whole prompt, e.g. for the prompt's
    log-probabilities; what it computes is still cached for others)."""
    _ids: np.ndarray = field(default_factory=lambda: _NO_TOKENS, repr=False)
    _known: int = 0

    def ids(self, tokens: Sequence[int], end: int) -> np.ndarray:
        """``tokens[:end]`` as int64 ids: a view of a copy kept with the request, to which only
        tokens not seen before are converted (a request's tokens only grow, by appending).
        Never written below ``_known``: views handed out stay valid."""
        known = self._known
        if end > known:
            if end > self._ids.size:
                grown = np.empty(max(end, 2 * self._ids.size, 64), dtype=np.int64)
                grown[:known] = self._ids[:known]
                self._ids = grown
            self._ids[known:end] = tokens[known:end]
            self._known = end
        return self._ids[:end]

    @property
    def length(self) -> int:
        return 0 if self.handle is None else self.handle.seq_len

    @property
    def live(self) -> KVHandle:
        """The handle of an admitted request."""
        if self.handle is None:
            raise RuntimeError("this request holds no memory: admit it first")
        return self.handle

    @property
    def token_locs(self) -> np.ndarray:
        """Virtual token locations of the request's whole sequence (empty without a handle)."""
        return _NO_TOKENS if self.handle is None else self.handle.token_locs()

    @property
    def slot(self) -> int | None:
        return None if self.handle is None else self.handle.state_slot


def live_handles(reqs: Sequence[RequestMemory]) -> list[KVHandle]:
    """The handles of admitted requests (``RequestMemory.live`` for many, with one check)."""
    handles = [r.handle for r in reqs]
    if None in handles:
        raise RuntimeError("this request holds no memory: admit it first")
    return handles  # type: ignore[return-value]  # None is not in it


class RequestAllocator:
    def __init__(
        self,
        mem: UnifiedMemory,
        *,
        prefix_cache: bool = True,
        cache_policy: str = "lru",
        checkpoints: str | CheckpointPlacement = DEFAULT,
    ):
        """``checkpoints``: the state checkpoint placement (``hybridkv.cache.placement``)."""
        self.mem = mem
        self.cache = HybridRadixCache(mem, policy=cache_policy)
        self.kvm = KVManager(self.cache, checkpoints, park_windows=prefix_cache)  # nothing inserted: nothing to keep
        self.prefix_cache = prefix_cache
        self.has_state = self.kvm.has_state
        self.model_has_state = bool(mem.shard.model.layer_ids(KindTag.LINEAR))
        """Some rank of the model's layout holds recurrent state (this one may not: a PP stage)."""
        self.page_size = mem.page_size
        self.tiers: EngineTiers | None = None
        """Tiers below the device (host memory, a store), set by the engine before any request (on
        every rank of a multi-process engine, or on none: ``admit`` agrees on the restored hit)."""

    def new(self, namespace: Hashable = None, tokens: Sequence[int] | None = None, reuse: bool = True) -> RequestMemory:
        """A request holding nothing yet (its handle comes with ``admit``). With tiers and its
        ``tokens``, its hit across the tiers is planned now and the store's reads start while it waits.
        ``reuse`` False: it never starts from a hit (``RequestMemory.reuse``)."""
        req = RequestMemory(namespace=namespace, reuse=reuse)
        if self.tiers is not None and self.prefix_cache and reuse and tokens is not None:
            key = req.ids(tokens, len(tokens) - 1)
            req.fetched = self.tiers.plan(key, namespace, self.kvm.match(key, namespace))
        return req

    def admit(
        self,
        req: RequestMemory,
        tokens: Sequence[int],
        prompt_len: int,
        chunk: int,
        extra_pages: int,
        alone: bool,
        agree: Agreement = ALONE,
    ) -> Admission:
        """Match ``tokens`` (all but the last: one token is always computed, for its logits) and
        admit the hit when its state slot and the pages of its first chunk (+ ``extra_pages``,
        what the running requests' step takes) fit, evicting from the cache for them. ``alone``
        (nothing else holds memory): admit whenever the slot fits (the step's allocation
        decides), ``TOO_BIG`` when even the slot does not. Every rank of ``agree`` admits at the
        same hit length or refuses alike. Refused: nothing held."""
        kvm, tiers = self.kvm, self.tiers
        key = req.ids(tokens, len(tokens) - 1) if self.prefix_cache and req.reuse else _NO_TOKENS
        match, branch_at = self._agreed_match(key, req.namespace, agree)
        fetched, full = None, 0
        if tiers is not None and self.prefix_cache and req.reuse:  # every rank of ``agree`` has tiers, or none
            fetched, full = tiers.agreed(req.fetched, key, req.namespace, match, agree)
            req.fetched = fetched
        start = match.length if fetched is None else fetched.plan.tokens
        handle: KVHandle | None = None
        got = Admission.ADMITTED
        try:
            handle = kvm.admit(match, req.namespace)
        except OutOfMemory:
            got = Admission.TOO_BIG if alone else Admission.REFUSED
        if handle is not None:
            need = handle.pages_needed(start + min(chunk, len(tokens) - start)) + extra_pages
            if not self.mem.pages_fit(need):
                kvm.evict({PAGE_NEED: need - self.mem.available_pages()})
                if not self.mem.pages_fit(need) and not alone:
                    got = Admission.REFUSED
        got = Admission(agree.min([got.value])[0])
        if got is not Admission.ADMITTED:
            if handle is not None:
                kvm.release(handle)
            return got
        assert handle is not None
        start, details = match.length, None
        if fetched is not None:
            assert tiers is not None
            req.fetched = None
            try:
                handle, start = tiers.restore(handle, match, fetched, agree)
            except OutOfMemory:  # fell back, released, and no room to admit again on some rank: nothing held
                return Admission.TOO_BIG if alone else Admission.REFUSED
            details = tiers.details(fetched, start)
        if tiers is not None:
            branch_at = tiers.branch_at(full, start, branch_at)
        req.handle = handle
        req.fresh = self.has_state and handle.state_from_zero
        if req.hit is None:
            req.hit = CacheHit.of(match, details)
        req.cached_tokens += start
        if self.prefix_cache and self.model_has_state:  # every rank cuts the same chunks, with state or not
            req.wanted = kvm.placement.prefill(branch_at, prompt_len, start)
        else:
            req.wanted = ()
        return got

    def _agreed_match(self, key: np.ndarray, namespace: Hashable, agree: Agreement) -> tuple[MatchResult, int | None]:
        """The longest match of ``key`` that every rank of ``agree`` holds (stages hold other pools, so
        their hits may differ: match, agree on the shortest, match that prefix again, until all agree),
        and the branch point every rank's cached full KV reaches past it (where the placement's
        ``branch`` wants a checkpoint; None when there is none)."""
        match = self.kvm.match(key, namespace)
        full = match.checkpoint_at if match.checkpoint_at is not None else match.length
        shortest, longest, full = agree.min([match.length, -match.length, full])
        while shortest != -longest:
            match = self.kvm.match(key[:shortest], namespace)
            shortest, longest = agree.min([match.length, -match.length])
        return match, (full if full > match.length else None)

    def reserve(self, req: RequestMemory, seq_len: int) -> None:
        """Hold pages (and a state slot) for ``seq_len`` tokens whose KV and state will arrive by
        transfer (a RECEIVING handle: nothing reads, matches or evicts it until ``received``);
        ``OutOfMemory``: nothing held."""
        if req.handle is not None:
            raise RuntimeError("reserve: the request already holds memory")
        req.handle = self.kvm.reserve(seq_len, req.namespace)
        req.fresh = False

    def received(self, req: RequestMemory) -> None:
        """The reserved KV and state arrived: the request continues from there."""
        self.kvm.received(req.live)

    def pages_needed(self, reqs: list[RequestMemory], lengths: list[int]) -> int:
        """Fresh pages requests ``reqs`` need, summed, to hold ``lengths[i]`` tokens each."""
        ps = self.page_size
        return sum(fresh_pages(n, h.n_pages, ps) for h, n in zip(live_handles(reqs), lengths, strict=True))

    def step_rows(self, reqs: list[RequestMemory]) -> tuple[list[np.ndarray], list[int] | None, list[bool] | None]:
        """What a forward batch reads of each request: its page row, and (with recurrent layers) its running state
        slot and whether that state starts from zero."""
        handles = live_handles(reqs)
        pages = KVHandle.rows(handles)
        if not self.has_state:
            return pages, None, None
        return pages, [h.state_slot or 0 for h in handles], [r.fresh for r in reqs]

    def extend(self, reqs: list[RequestMemory], lengths: list[int]) -> None:
        """Grow request ``i`` to ``lengths[i]`` tokens (prefill chunks and decodes alike), one allocation;
        a request already that long grows no further (a step retried after a retraction)."""
        self.kvm.extend_batch(live_handles(reqs), lengths)

    def mark_computed(self, reqs: list[RequestMemory], release_windows: bool = True) -> None:
        """After a forward: states now hold real data, and pages may have left windows (released
        unless ``release_windows`` is False: a prefill engine's sender reads the whole prompt's KV)."""
        handles = live_handles(reqs)
        for req in reqs:
            req.fresh = False
        if release_windows and self.kvm.has_windows:
            self.kvm.release_windows(handles)

    def reserve_chunk_checkpoints(self, reqs: list[RequestMemory], ends: list[int]) -> list[int]:
        """Before a step's forward: a checkpoint slot for each prefill chunk of ``reqs`` that ends (at ``ends[i]``)
        where one is wanted, -1 elsewhere; the forward writes the state there with the running state
        (``ForwardBatch.checkpoint_slots``) and ``chunk_done`` finds it taken. One allocation for all; without
        room for it none is reserved (``chunk_done`` then copies, room permitting)."""
        out = [-1] * len(reqs)
        if not self.has_state:  # ranks without recurrent layers cut chunks alike, store nothing
            return out
        handles = live_handles(reqs)
        rows = [
            i
            for i, (req, h, end) in enumerate(zip(reqs, handles, ends, strict=True))
            if end in req.wanted and end > h.cached * self.page_size and end not in h.checkpoints
        ]
        if not rows:
            return out
        try:
            slots = self.kvm.checkpoints.reserve_step([handles[i] for i in rows], [ends[i] for i in rows])
        except OutOfMemory:
            return out
        for i, slot in zip(rows, slots.tolist(), strict=True):
            out[i] = slot
        return out

    def chunk_done(self, req: RequestMemory, tokens: Sequence[int]) -> None:
        """After a prefill chunk: a checkpoint when it ends where one is wanted (a copy of the state now, unless
        ``reserve_chunk_checkpoints`` had the forward write it), then cache the computed pages."""
        h = req.live
        end = h.seq_len
        if end in req.wanted and self.has_state:  # ranks without recurrent layers cut chunks alike, store nothing
            self._checkpoint(h)
        if self.prefix_cache and end // self.page_size > h.cached:
            self.kvm.insert(h, req.ids(tokens, end))

    def finish(self, req: RequestMemory, tokens: Sequence[int]) -> None:
        """Cache the finished sequence, its state checkpointed at the end when the placement
        wants one there and the final length is page-aligned (the state exists only there: the
        running slot itself becomes the checkpoint), release."""
        self.finish_all([req], [tokens])

    def finish_all(self, reqs: list[RequestMemory], tokens: list[Sequence[int]]) -> None:
        """``finish`` of every request of ``reqs`` (a step's ended requests): each cached, all released at once."""
        handles = live_handles(reqs)
        for req in reqs:
            req.handle = None
        if not self.prefix_cache:
            self.kvm.release_all(handles)
            return
        for h in handles:
            if self.kvm.checkpoints.at_finish(h) == h.seq_len and h.seq_len > h.cached * self.page_size:
                self.kvm.checkpoints.take_final(h)  # the running state itself: the request computes no more
        ids = [req.ids(t, h.seq_len) for req, t, h in zip(reqs, tokens, handles, strict=True)]
        self.kvm.finish_all(handles, ids)

    def retract(self, req: RequestMemory) -> None:
        """Give back what the request holds; what it inserted stays cached for its resumption."""
        if req.handle is not None:
            self.kvm.release(req.handle)
            req.handle = None
        if req.fetched is not None:
            assert self.tiers is not None
            self.tiers.cancel(req.fetched)
            req.fetched = None
        req.fresh, req.wanted = True, ()

    def _checkpoint(self, h: KVHandle) -> None:
        """Store the state after ``h.seq_len`` tokens (a position the placement asked for)."""
        if h.seq_len <= h.cached * self.page_size or h.seq_len in h.checkpoints:
            return  # the cache holds this position already (an insert reached it)
        try:
            self.kvm.checkpoints.take(h)
        except OutOfMemory:  # a checkpoint is an optimisation: without room for it, the request goes on
            return

    def clear_cache(self) -> None:
        """Evict everything unlocked from the cache."""
        self.kvm.evict({PAGE_NEED: self.mem.pages.capacity})
