"""RequestKV: the scheduler's one way into KV memory, four verbs over ``KVManager`` (as vLLM's ``KVCacheManager``).

A request holds its KV in one ``KVHandle`` (``Request.kv``) of a ``KVManager`` above a ``HybridRadixCache``.
Its row at a step that computes ``span`` tokens after ``computed``::

    0                  kv.cached * page_size                 computed              computed + span
    |--------------------------|-------------------------------|-----------------------------|
    | < cached: the hit,       | < own, computed >             | < fresh pages: this step >  |
    |   locked (admit) >       |                               |   (allocate)                |
    |--------------------------|-------------------------------|-----------------------------|
    | < out of every window: released, window-cached >  | < window's live part >              |
    |----------------------------------------------------|-------------------------------------|
                      ^ checkpoint        ^ checkpoint                              ^ checkpoint
                      (page bounds the placement wants: ``Request.wanted``)          reserved by allocate
                                                                   |< to be computed >           |

- ``admit(req, budget)``: match the known tokens (all but the last, in the request's ``cache_salt``),
  agree on the hit with the other ranks, restore it from the tiers below, lock it: ``req.kv`` holds the cached
  part (and a state slot, forked from the hit's checkpoint or fresh); refused when its first chunk does not fit.
  A RECEIVING request (decode role) instead reserves pages and a slot for its prompt, arriving by transfer.
- ``allocate(reqs, spans)``: grow every request of the step to ``computed + span`` in one allocation (the cache
  evicts what it is short of), agreed, and reserve the checkpoint slots this step's chunks end at: the rows the
  forward reads.
- ``computed(reqs)``: after the forward: release the pages that left every window (window-cached: kept for hits
  until memory is needed), store a chunk's checkpoint where one is wanted and insert the computed pages. A
  RECEIVING request: its KV arrived.
- ``free(*reqs, cache)``: ``cache``: insert the finished sequence (the running state becomes a checkpoint at
  its end when the placement wants one there and the end is page-aligned), release the rest; else release
  (what was inserted stays cached for its resumption) and cancel a planned restore.

Besides them: ``plan`` starts a waiting request's reads from the store (a prefetch: no device memory),
``pages_needed`` prices a step (it changes nothing), ``clear_cache`` is an admin verb (not per request).

With tiers below the device (``EngineTiers``: host memory, the Mooncake Store), ``plan`` plans a request's hit
across them while it waits; ``admit`` re-plans when the device hit moved, agrees on the restored length with the
other ranks (``EngineTiers.agreed``), reserves the pages up to it and copies the pieces in (``EngineTiers.restore``):
computation starts at the restored end, or at the device hit when an object was missing on any rank (a miss with
a reason, never garbage). With ``prefix_cache=False`` nothing is matched or inserted: the same path, without hits.

Invariants:
- A request holds memory exactly while ``req.kv`` is set; ``allocate`` either grows every request of the step
  to its length or changes no handle (``OutOfMemory``, agreed over the ranks).
- ``req.kv.seq_len`` equals ``req.computed`` after each forward; its state slot holds the state after them
  (``req.fresh``: zero it before the next forward).
- Checkpoints sit only at the placement's page-aligned positions past the cached part; every free goes through
  the manager's sync-free paths (``free_pages`` / ``windows.free`` / ``free_state``).
- Decisions that depend on a rank's memory (the hit, the admission, the step's allocation) go through an
  ``Agreement``, so that every rank of a multi-process engine decides alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from hybridkv.cache import PAGE_NEED, CheckpointPlacement, HybridRadixCache, KVHandle, KVManager, MatchResult
from hybridkv.cache.handle import fresh_pages
from hybridkv.cache.placement import DEFAULT
from hybridkv.engine.sched.agreement import ALONE, Agreement
from hybridkv.engine.sched.request import CacheHit, Request, RequestStatus
from hybridkv.engine.sched.tiered import EngineTiers
from hybridkv.memory import OutOfMemory, UnifiedMemory
from hybridkv.spec import KindTag

_NO_TOKENS = np.empty(0, dtype=np.int64)


class Admission(Enum):
    """What ``admit`` decided; ordered so that the minimum over ranks is the decision of all."""

    TOO_BIG = 0  # not even its state slot fits with nothing else held: it fails alone
    REFUSED = 1  # not now: it waits
    ADMITTED = 2


@dataclass(frozen=True)
class Budget:
    """What an admission may take: its first chunk's ``tokens`` on top of the ``pages`` the step already takes;
    ``alone`` (nothing else holds memory): admitted whenever its state slot fits (the step's allocation decides)."""

    tokens: int
    pages: int = 0
    alone: bool = False


@dataclass(frozen=True)
class StepRows:
    """What a step's forward reads of each request: its page row and, with recurrent layers, its running state
    slot, whether that state starts from zero, and the checkpoint slot its chunk ends at (-1: none; None: no
    row has one)."""

    pages: list[np.ndarray]
    slots: list[int] | None
    fresh: list[bool] | None
    checkpoints: list[int] | None


def held(reqs: Sequence[Request]) -> list[KVHandle]:
    """The handles of admitted requests, with one check."""
    handles = [r.kv for r in reqs]
    if None in handles:
        raise RuntimeError("this request holds no memory: admit it first")
    return handles  # type: ignore[return-value]  # None is not in it


class RequestKV:
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

    # --- the four verbs ------------------------------------------------------------------

    def admit(self, req: Request, budget: Budget, agree: Agreement = ALONE) -> Admission:
        """Match the request's tokens (all but the last: one token is always computed, for its logits) and
        admit the hit when its state slot and the pages of its first chunk (``budget``) fit, evicting from the
        cache for them. Every rank of ``agree`` admits at the same hit length or refuses alike. Refused: nothing
        held. A RECEIVING request reserves its prompt's pages and slot instead (nothing reads, matches or evicts
        them until ``computed``), on every rank or on none."""
        if req.status is RequestStatus.RECEIVING:
            return self._reserve(req, agree)
        kvm, tiers, tokens = self.kvm, self.tiers, req.tokens
        key = req.ids(len(tokens) - 1) if self.prefix_cache and req.reuse else _NO_TOKENS
        match, branch_at = self._agreed_match(key, req.cache_salt, agree)
        fetched, full = None, 0
        if tiers is not None and self.prefix_cache and req.reuse:  # every rank of ``agree`` has tiers, or none
            fetched, full = tiers.agreed(req.fetched, key, req.cache_salt, match, agree)
            req.fetched = fetched
        start = match.length if fetched is None else fetched.plan.tokens
        handle: KVHandle | None = None
        got = Admission.ADMITTED
        try:
            handle = kvm.admit(match, req.cache_salt)
        except OutOfMemory:
            got = Admission.TOO_BIG if budget.alone else Admission.REFUSED
        if handle is not None:
            need = handle.pages_needed(start + min(budget.tokens, len(tokens) - start)) + budget.pages
            if not self.mem.pages_fit(need):
                kvm.evict({PAGE_NEED: need - self.mem.available_pages()})
                if not self.mem.pages_fit(need) and not budget.alone:
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
                return Admission.TOO_BIG if budget.alone else Admission.REFUSED
            details = tiers.details(fetched, start)
        if tiers is not None:
            branch_at = tiers.branch_at(full, start, branch_at)
        req.kv = handle
        req.fresh = self.has_state and handle.state_from_zero
        if req.hit is None:
            req.hit = CacheHit.of(match, details)
        req.cached_tokens += start
        if self.prefix_cache and self.model_has_state:  # every rank cuts the same chunks, with state or not
            req.wanted = kvm.placement.prefill(branch_at, len(req.prompt), start)
        else:
            req.wanted = ()
        return got

    def allocate(self, reqs: list[Request], spans: list[int], agree: Agreement = ALONE) -> StepRows:
        """Grow request ``i`` to ``computed + spans[i]`` tokens (prefill chunks and decodes alike), one allocation
        on every rank of ``agree`` or on none (``OutOfMemory``: no handle changed here; a rank that grew keeps
        it, and a request already that long grows no further when the step is tried again), then reserve a
        checkpoint slot for each prefill chunk that ends where one is wanted (the forward writes the state there
        with the running state; without room for them none is reserved and ``computed`` copies, room
        permitting). The rows the forward reads."""
        handles = held(reqs)
        short = ""
        try:
            self.kvm.extend_batch(handles, [r.computed + s for r, s in zip(reqs, spans, strict=True)])
        except OutOfMemory as exc:
            short = str(exc)
        if not agree.min([0 if short else 1])[0]:
            raise OutOfMemory(short or "another rank of this engine is out of memory")
        pages = KVHandle.rows(handles)
        if not self.has_state:
            return StepRows(pages, None, None, None)
        slots = [h.state_slot or 0 for h in handles]
        return StepRows(pages, slots, [r.fresh for r in reqs], self._step_checkpoints(reqs, handles, spans))

    def computed(self, reqs: list[Request], release_windows: bool = True) -> None:
        """After a forward: states now hold real data, pages may have left windows (released unless
        ``release_windows`` is False: a prefill engine's sender reads the whole prompt's KV), and each prefill
        chunk (``computed`` not yet advanced past it) stores its checkpoint where one is wanted and inserts its
        computed pages. A RECEIVING request (alone): its reserved KV and state arrived, it continues from there."""
        if len(reqs) == 1 and reqs[0].status is RequestStatus.RECEIVING:
            self.kvm.received(held(reqs)[0])
            return
        handles = held(reqs)
        for req in reqs:
            req.fresh = False
        if release_windows and self.kvm.has_windows:
            self.kvm.release_windows(handles)
        ps = self.page_size
        for req, h in zip(reqs, handles, strict=True):
            if req.computed >= len(req.tokens) - 1:  # a decode
                continue
            end = h.seq_len
            if end in req.wanted and self.has_state:  # ranks without recurrent layers cut chunks alike, store nothing
                self._checkpoint(h)
            if self.prefix_cache and end // ps > h.cached:
                self.kvm.insert(h, req.ids(end))

    def free(self, *reqs: Request, cache: bool) -> None:
        """Give back what ``reqs`` hold. ``cache``: each (admitted) request's computed sequence is cached, its
        state checkpointed at the end when the placement wants one there and the end is page-aligned (the state
        exists only there: the running slot itself becomes the checkpoint), then all are released at once.
        Otherwise released as they stand (what they inserted stays cached) and a planned restore's reads are
        cancelled."""
        if not cache:
            for req in reqs:
                self._retract(req)
            return
        handles = held(reqs)
        for req in reqs:
            req.kv = None
        if not self.prefix_cache:
            self.kvm.release_all(handles)
            return
        for h in handles:
            if self.kvm.checkpoints.at_finish(h) == h.seq_len and h.seq_len > h.cached * self.page_size:
                self.kvm.checkpoints.take_final(h)  # the running state itself: the request computes no more
        self.kvm.finish_all(handles, [req.ids(h.seq_len) for req, h in zip(reqs, handles, strict=True)])

    # --- besides them ----------------------------------------------------------------------

    def plan(self, req: Request) -> None:
        """With tiers, plan a queued request's hit across them now, so the store's reads run while it waits (a
        prefetch: it holds no device memory; ``free`` cancels it)."""
        if self.tiers is not None and self.prefix_cache and req.reuse:
            key = req.ids(len(req.tokens) - 1)
            req.fetched = self.tiers.plan(key, req.cache_salt, self.kvm.match(key, req.cache_salt))

    def pages_needed(self, reqs: list[Request], ends: list[int]) -> int:
        """Fresh pages requests ``reqs`` need, summed, to hold ``ends[i]`` tokens each (a price: nothing changes)."""
        ps = self.page_size
        return sum(fresh_pages(n, h.n_pages, ps) for h, n in zip(held(reqs), ends, strict=True))

    def clear_cache(self) -> None:
        """Evict everything unlocked from the cache (an admin verb: what requests hold stays)."""
        self.kvm.evict({PAGE_NEED: self.mem.pages.capacity})

    # --- inside ----------------------------------------------------------------------------

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

    def _reserve(self, req: Request, agree: Agreement) -> Admission:
        """Hold pages (and a state slot) for the prompt of a RECEIVING request, on every rank of ``agree`` or none."""
        if req.kv is not None:
            raise RuntimeError("reserve: the request already holds memory")
        try:
            req.kv = self.kvm.reserve(len(req.prompt), req.cache_salt)
            ok = 1
        except OutOfMemory:
            ok = 0
        req.fresh = False
        if not agree.min([ok])[0]:
            self._retract(req)
            return Admission.REFUSED
        return Admission.ADMITTED

    def _retract(self, req: Request) -> None:
        if req.kv is not None:
            self.kvm.release(req.kv)
            req.kv = None
        if req.fetched is not None:
            assert self.tiers is not None
            self.tiers.cancel(req.fetched)
            req.fetched = None
        req.fresh, req.wanted = True, ()

    def _step_checkpoints(self, reqs: list[Request], handles: list[KVHandle], spans: list[int]) -> list[int] | None:
        """A checkpoint slot for each prefill chunk of the step that ends where one is wanted and not yet stored,
        -1 elsewhere; None when there is none (or no room for them: one allocation for all)."""
        ps = self.page_size
        rows, ends = [], []
        for i, (req, h, span) in enumerate(zip(reqs, handles, spans, strict=True)):
            end = req.computed + span
            chunk = req.wanted and req.computed < len(req.tokens) - 1  # a prefill chunk of a request wanting some
            if chunk and end in req.wanted and end > h.cached * ps and end not in h.checkpoints:
                rows.append(i)
                ends.append(end)
        if not rows:
            return None
        try:
            slots = self.kvm.checkpoints.reserve_step([handles[i] for i in rows], ends)
        except OutOfMemory:
            return None
        out = [-1] * len(reqs)
        for i, slot in zip(rows, slots.tolist(), strict=True):
            out[i] = slot
        return out

    def _checkpoint(self, h: KVHandle) -> None:
        """Store the state after ``h.seq_len`` tokens (a position the placement asked for)."""
        if h.seq_len <= h.cached * self.page_size or h.seq_len in h.checkpoints:
            return  # the cache holds this position already (an insert reached it)
        try:
            self.kvm.checkpoints.take(h)
        except OutOfMemory:  # a checkpoint is an optimisation: without room for it, the request goes on
            return
