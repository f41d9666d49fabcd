"""Serve a workload through memory + cache, tables only: what hit rate and capacity a model
gets on real traffic, without computing the model.

One engine step: admit waiting requests in arrival order (match, lock, allocate their new
prompt tokens in chunks, drop prompt pages that left a sliding window, insert the prompt
into the cache and relock), then one batched decode of ``decode_chunk`` tokens for every
running request (one batched page allocation, one batched window free per pool), then
finish the requests that generated ``output_length`` tokens (insert prompt + output,
free the unaligned tail, unlock). The clock advances by ``prefill tokens / prefill rate
+ decode_chunk * decode step time``; requests arrive by timestamp (a later turn once its
previous turn finished). When memory is short the cache evicts what the allocator is short
of; when nothing is evictable, admission waits, and a decode that cannot grow retracts the
newest request (it restarts later; its prompt stays cached).

Hybrid rules: a request whose hit stops short of the cached full KV (``checkpoint_at``)
keeps the window there. State checkpoints go where the manager's placement wants them
(``ReplayConfig.checkpoints``, ``cache/placement.py``: by default the branch point and the
prompt's and the sequence's page-aligned ends), reserved at admission like the prompt's
pages, in one allocation (a request waits for them; one that cannot fit with them even
alone goes on without them), and at finish for the sequence end (skipped when even eviction
finds no room); skipped ones are counted. A hit is capped at ``input_length - 1`` tokens:
the engine computes at least one token.

Every step of a request's KV goes through ``KVManager`` (one ``KVHandle`` per running
request): allocation with eviction, window release, checkpoints, insert, release.

A request's token ids are built when it is admitted (``ReplayRequest.input_ids``) and dropped
when it finishes or is retracted: only running requests hold ids.

Invariants: every request is served exactly once (a retracted one restarts from its hit);
after the run, every page and slot still live belongs to the cache (``verify`` checks
both the memory and the tree when asked).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridkv.cache import PAGE_NEED, HybridRadixCache, KVHandle, KVManager
from hybridkv.cache.placement import DEFAULT
from hybridkv.memory import OutOfMemory, UnifiedMemory, parse_bytes
from hybridkv.replay.tiered import ReplayTiers, TierConfig
from hybridkv.replay.workload import ReplayRequest, Workload
from hybridkv.spec import ShardSpec, get_preset


class ReplayError(RuntimeError):
    """A replay that cannot go on (a request that can never fit); the message says what to change."""


@dataclass(frozen=True)
class EngineModel:
    """The simulated engine's clock and batch limits (no model compute; these set the time)."""

    prefill_tokens_per_s: float = 50_000.0
    decode_step_s: float = 0.025
    """One decode step of the whole batch (time per output token)."""
    decode_chunk: int = 16
    """Tokens every running request generates per simulated decode batch."""
    max_running: int = 128
    max_prefill_tokens: int = 16_384
    """New prompt tokens admitted per step (at least one request is admitted)."""
    chunk_tokens: int = 8192
    """Prefill chunk: window pages that leave the window are freed between chunks."""


@dataclass(frozen=True)
class ReplayConfig:
    model: str
    gpu_memory: str | int
    """KV budget of the arena (bytes, or e.g. "40GiB")."""
    page_size: int = 16
    policy: str = "lru"
    cache_tokens: int | None = None
    """Most tokens the cache may keep (None: bounded by memory only)."""
    max_checkpoints_per_path: int = 8
    checkpoints: str = DEFAULT
    """State checkpoint placement spec (``cache/placement.py``), e.g. "interval:512,branch"."""
    engine: EngineModel = field(default_factory=EngineModel)
    samples: int = 200
    """Samples of the pool split over the trace's time span."""
    verify_every: int = 0
    """Run ``mem.verify()`` and ``cache.check()`` every N steps (0: only at the end)."""
    tiers: TierConfig | None = None
    """Host memory and/or a store below the device (``tiered.py``); None: the device only."""


@dataclass
class _Running:
    req: ReplayRequest
    kv: KVHandle
    tokens: np.ndarray
    """The request's input ids, built at admission, dropped with it."""
    generated: int = 0

    @property
    def seq_len(self) -> int:
        return self.req.input_length + self.generated


@dataclass
class ReplayResult:
    """Raw counts of one replay; ``report.build_report`` turns them into figures."""

    config: ReplayConfig
    workload: str
    model: str
    """The preset's full name."""
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    """Tokens of the device's own hits (``hit_tokens`` less what tiers below restored)."""
    full_hit_tokens: int = 0
    window_hit_tokens: int = 0
    window_hit_tokens_each: dict[str, int] = field(default_factory=dict)
    """Per window pool (its label): tokens of the hits valid for full KV and that window alone."""
    checkpoint_hit_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    recomputed_tokens: int = 0
    """Prefill tokens whose full KV the cache held (each admission's ``full_length - length``)."""
    checkpoints_skipped: int = 0
    """Checkpoints the placement wanted that found no room even after eviction."""
    peak_checkpoint_slots: int = 0
    """Most state slots held as checkpoints (cached or reserved) after any step."""
    end_checkpoint_slots: int = 0
    state_slot_bytes: int = 0
    retractions: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    peak_live_pages: int = 0
    steps: int = 0
    sim_seconds: float = 0.0
    trace_seconds: float = 0.0
    """Span of the arrivals: a simulation much longer than this means the engine fell behind."""
    wall_seconds: float = 0.0
    cache: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    pools: tuple[str, ...] = ()
    timeline: list[dict[str, Any]] = field(default_factory=list)
    hits: dict[int, int] = field(default_factory=dict)
    """Tokens hit per request id (at its first admission)."""
    tiers: dict[str, Any] = field(default_factory=dict)
    """The tier layer's report (``ReplayTiers.report``), when the replay has tiers."""


class Simulator:
    def __init__(self, workload: Workload, config: ReplayConfig):
        if not workload.requests:
            raise ReplayError(f"workload {workload.name} has no requests")
        self.workload = workload
        self.config = config
        self.engine = config.engine
        longest = max(r.input_length + r.output_length for r in workload.requests)
        spec = get_preset(config.model)
        self.mem = UnifiedMemory.create(
            ShardSpec.whole(spec),
            parse_bytes(config.gpu_memory),
            device="meta",
            page_size=config.page_size,
            max_context=max(longest, config.page_size),
            chunk_tokens=min(config.engine.chunk_tokens, longest),
        )
        self.cache = HybridRadixCache(
            self.mem, policy=config.policy, max_checkpoints_per_path=config.max_checkpoints_per_path
        )
        self.kvm = KVManager(self.cache, config.checkpoints)
        self.ps = config.page_size
        self.chunk = self.mem.plan.chunk_tokens
        self.tiers = ReplayTiers(self.kvm, config.tiers, self.chunk) if config.tiers is not None else None
        self.result = ReplayResult(config, workload.name, spec.name, pools=tuple(str(p) for p in self.mem.pools))
        self._window_labels = tuple(w.label for w in self.cache.rules.windows)
        self.result.window_hit_tokens_each = dict.fromkeys(self._window_labels, 0)
        state_rule = self.cache.rules.checkpoint
        self.result.state_slot_bytes = state_rule.cell_bytes if state_rule is not None else 0
        self.clock = 0.0
        self._admitted: set[int] = set()
        self._stalled = False
        """Admission failed for lack of memory; retried once a request has finished."""

    # --- the run --------------------------------------------------------------------------

    def run(self, progress: Callable[[int, int], None] | None = None) -> ReplayResult:
        requests = self.workload.requests
        arrivals = deque(r for r in requests if r.after is None)
        blocked: dict[int, list[ReplayRequest]] = {}
        for request in requests:
            if request.after is not None:
                blocked.setdefault(request.after, []).append(request)
        waiting: deque[ReplayRequest] = deque()
        ready: list[tuple[float, int, ReplayRequest]] = []  # heap of unblocked follow-up turns
        running: list[_Running] = []
        done = 0
        span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
        next_sample = 0.0
        started = time.perf_counter()
        res = self.result
        while done < len(requests):
            if not waiting and not running:
                nxt = [ready[0][0]] if ready else []
                nxt += [arrivals[0].arrival_s] if arrivals else []
                if not nxt:
                    raise ReplayError("requests wait on turns that never finish (trace order bug)")
                self.clock = max(self.clock, min(nxt))
            while arrivals and arrivals[0].arrival_s <= self.clock:
                waiting.append(arrivals.popleft())
            while ready and ready[0][0] <= self.clock:
                waiting.append(heapq.heappop(ready)[2])
            prefilled = self._admit(waiting, running)
            generated = self._decode(running, waiting) if running else 0
            self.clock += prefilled / self.engine.prefill_tokens_per_s + generated * self.engine.decode_step_s
            if self.tiers is not None:
                self.clock += self.tiers.take_seconds()
            for r in [r for r in running if r.generated >= r.req.output_length]:
                running.remove(r)
                self._finish(r)
                done += 1
                for follower in blocked.pop(r.req.rid, []):
                    heapq.heappush(ready, (max(follower.arrival_s, self.clock), follower.rid, follower))
                if progress is not None:
                    progress(done, len(requests))
            self.mem.flush_tables()
            res.steps += 1
            res.peak_running = max(res.peak_running, len(running))
            res.peak_waiting = max(res.peak_waiting, len(waiting))
            res.peak_live_pages = max(res.peak_live_pages, self.mem.pages.live_count)
            if self.kvm.has_state:  # every live slot but the running states is a checkpoint
                res.peak_checkpoint_slots = max(res.peak_checkpoint_slots, self.mem.slots.live_count - len(running))
            if self.clock >= next_sample:
                res.timeline.append(self._sample(len(running), len(waiting)))
                next_sample = self.clock + max(span, 1.0) / max(1, self.config.samples)
            if self.config.verify_every and res.steps % self.config.verify_every == 0:
                self.verify()
        res.timeline.append(self._sample(0, 0))
        res.end_checkpoint_slots = self.cache.num_checkpoints
        res.sim_seconds = self.clock
        res.trace_seconds = span
        res.wall_seconds = time.perf_counter() - started
        res.cache = self.cache.stats()
        res.memory = self.mem.stats().as_dict()
        if self.tiers is not None:
            res.tiers = self.tiers.report(res.input_tokens, res.hit_tokens, res.device_hit_tokens)
            self.tiers.close()
        return res

    def verify(self) -> None:
        self.mem.verify()
        self.cache.check()

    # --- admission ------------------------------------------------------------------------

    def _admit(self, waiting: deque[ReplayRequest], running: list[_Running]) -> int:
        prefilled = 0
        if not running:
            self._stalled = False  # nothing holds memory but the cache: always try
        while waiting and len(running) < self.engine.max_running and not self._stalled:
            if prefilled and prefilled >= self.engine.max_prefill_tokens:
                break
            got = self._prefill(waiting[0])
            if got is None and not running and not prefilled:  # alone: without its checkpoints, if they are why
                got = self._prefill(waiting[0], with_checkpoints=False)
            if got is None:
                self._stalled = True
                if not running and not prefilled:
                    req = waiting[0]
                    raise ReplayError(
                        f"request {req.rid} ({req.input_length} prompt + {req.output_length} output "
                        f"tokens) does not fit in {self.config.gpu_memory} of {self.config.model} "
                        "KV even with an empty cache; raise --gpu-memory"
                    )
                break
            waiting.popleft()
            running.append(got[0])
            prefilled += got[1]
        return prefilled

    def _prefill(self, req: ReplayRequest, with_checkpoints: bool = True) -> tuple[_Running, int] | None:
        """Match, admit, reserve the placement's checkpoints, allocate and 'compute' the prompt,
        insert it; None if memory is short (for its pages or its checkpoints: it waits, as for
        pages). ``with_checkpoints=False``: a request alone that cannot fit with them goes on
        without them (counted as skipped)."""
        kvm = self.kvm
        tokens = req.input_ids()
        prefix = tokens[: req.input_length - 1]
        match = kvm.match(prefix)
        tiers = self.tiers
        fetched = tiers.plan(match, prefix) if tiers is not None else None
        try:
            kv = kvm.admit(match)
        except OutOfMemory:
            if tiers is not None and fetched is not None:
                tiers.cancel(fetched)
            return None
        start = match.length
        if tiers is not None and fetched is not None:
            try:
                kv, start = tiers.restore(kv, match, fetched)
            except OutOfMemory:
                kvm.release(kv)
                return None
        if tiers is not None and fetched is not None:
            wanted = tiers.wanted_checkpoints(kv, fetched, req.input_length)
        else:
            wanted = kvm.checkpoints.wanted(kv, req.input_length)
        if not with_checkpoints:
            self.result.checkpoints_skipped += len(wanted)
        ends = deque(wanted)
        try:
            if with_checkpoints:
                kvm.checkpoints.reserve_each(kv, wanted)
            pos = start
            while pos < req.input_length:
                nxt = min(req.input_length, pos + self.chunk)
                if ends and ends[0] <= nxt:  # a chunk ends where a checkpoint is wanted
                    nxt = ends.popleft()
                kvm.extend(kv, nxt)
                kvm.release_windows([kv])
                pos = nxt
        except OutOfMemory:
            kvm.release(kv)
            return None
        kvm.insert(kv, tokens)
        self._cap_cache()
        computed = req.input_length - start
        res = self.result
        res.prefill_tokens += computed
        res.recomputed_tokens += max(0, match.full_length - start)
        if req.rid not in self._admitted:  # hits count once: a retracted request hits its own prompt
            self._admitted.add(req.rid)
            res.requests += 1
            res.input_tokens += req.input_length
            res.hit_tokens += start
            res.device_hit_tokens += match.length
            if tiers is not None and fetched is not None:
                tiers.record(fetched, start)
            res.full_hit_tokens += match.full_length
            res.window_hit_tokens += match.window_length
            for label, n in zip(self._window_labels, match.window_lengths, strict=True):
                res.window_hit_tokens_each[label] += n
            res.checkpoint_hit_tokens += match.checkpoint_length
            res.hits[req.rid] = start
        return _Running(req, kv, tokens), computed

    # --- decode ---------------------------------------------------------------------------

    def _decode(self, running: list[_Running], waiting: deque[ReplayRequest]) -> int:
        k = self.engine.decode_chunk
        while True:
            steps = [min(k, r.req.output_length - r.generated) for r in running]
            try:
                self.kvm.extend_batch(
                    [r.kv for r in running], [r.seq_len + s for r, s in zip(running, steps, strict=True)]
                )
                break
            except OutOfMemory:
                if len(running) == 1:
                    raise ReplayError(
                        f"request {running[0].req.rid} cannot grow to {running[0].seq_len + steps[0]} "
                        f"tokens in {self.config.gpu_memory} of {self.config.model} KV; raise --gpu-memory"
                    ) from None
                victim = running.pop()
                self.kvm.release(victim.kv)
                waiting.appendleft(victim.req)
                self.result.retractions += 1
                self._stalled = True  # re-admit it only once something finished
        for r, s in zip(running, steps, strict=True):
            r.generated += s
        self.kvm.release_windows([r.kv for r in running])
        generated = max(steps, default=0)
        self.result.decode_tokens += sum(steps)
        return generated

    # --- finish ---------------------------------------------------------------------------

    def _finish(self, r: _Running) -> None:
        self._stalled = False
        kv, req = r.kv, r.req
        seq = np.concatenate([r.tokens, req.output_ids()])
        at = self.kvm.checkpoints.at_finish(kv)
        if at is not None:
            try:
                self.kvm.checkpoints.reserve(kv, at)
            except OutOfMemory:  # no room even after eviction: cache the sequence without it
                self.result.checkpoints_skipped += 1
        self.kvm.finish(kv, seq)
        self._cap_cache()

    def _cap_cache(self) -> None:
        cap = self.config.cache_tokens
        if cap is not None and self.cache.cached_tokens > cap:
            self.cache.evict({PAGE_NEED: math.ceil((self.cache.cached_tokens - cap) / self.ps)})

    # --- samples --------------------------------------------------------------------------

    def _sample(self, running: int, waiting: int) -> dict[str, Any]:
        stats = self.mem.stats()
        return {
            "t": self.clock,
            "running": running,
            "waiting": waiting,
            "cached_tokens": self.cache.cached_tokens,
            "live_bytes": {str(p.pool_id): p.live_bytes for p in stats.pools},
            "free_bytes": sum(p.free_bytes for p in stats.pools) + stats.free_slab_bytes,
        }


def simulate(
    workload: Workload, config: ReplayConfig, progress: Callable[[int, int], None] | None = None
) -> ReplayResult:
    return Simulator(workload, config).run(progress)
