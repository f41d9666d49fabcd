"""Stateful tests of manager + cache + memory together, against a brute-force oracle.

Requests start through ``KVManager`` (match, admit, extend with eviction, maybe release
out-of-window pages: window-cached, reserve or copy state checkpoints: where the machine's
checkpoint placement wants them and at random positions), settle (insert their prompt and
relock), finish (insert, release) or abort (release), while the cache evicts on demand, on
its own and under allocation pressure (window-cached cells before anything the tree holds).
After every step: ``mem.verify()``, ``cache.check()`` (window-cached cells counted as their
own category by both), every running request still holds every page it needs (full KV, and
each window's span), and the event-fed oracle equals the tree. Every match must equal the
event oracle's longest valid hit, never exceed what was ever inserted, and equal it while
nothing was evicted. A request alone (nothing running) of up to ``max_context`` tokens, with
checkpoints reserved up front (the replay) or taken and inserted chunk by chunk (the engine),
always fits, whatever the cache holds, also at the feasibility floor (issue 19, item 9).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.cache import (
    PAGE_NEED,
    CacheError,
    CacheLock,
    HandleStatus,
    HybridRadixCache,
    InsertError,
    KVHandle,
    KVManager,
    LockError,
)
from hybridkv.memory import LayoutError, OutOfMemory
from tests.cache.helpers import FLOORS, assert_oracle_matches_tree, oracle_for, small_memory, tree_snapshot
from tests.memory.snapshots import assert_unchanged, snapshot

MAX_CONTEXT = 64
"""The longest request ``small_memory`` sizes for."""
STEMS = ((), (1,) * 8, (1,) * 8 + (2,) * 8, (3,) * 12, (1,) * 8 + (2,) * 4 + (0,) * 6)
NAMESPACES = (None, "tenant-b")
tokens_st = st.tuples(st.sampled_from(STEMS), st.lists(st.integers(0, 3), max_size=14)).map(
    lambda t: t[0] + tuple(t[1])
)


@dataclass
class Running:
    tokens: tuple[int, ...]
    namespace: object
    kv: KVHandle


class CacheMachine(RuleBasedStateMachine):
    preset = "tiny-swa2-state"
    policy = "lru"
    page_size = 4
    cap = 8
    placement = "prompt-aligned,branch,end"
    budget: int | None = None
    """Bytes of the memory (None: the preset's ``BUDGETS`` entry)."""

    def __init__(self) -> None:
        super().__init__()
        self.mem = small_memory(self.preset, self.page_size, self.budget)
        self.cache = HybridRadixCache(self.mem, policy=self.policy, max_checkpoints_per_path=self.cap, events=True)
        self.kvm = KVManager(self.cache, self.placement)
        self.exact = oracle_for(self.cache)
        self.inserted = oracle_for(self.cache)
        self.running: list[Running] = []
        self.released_locks: list[CacheLock] = []
        self.released: list[KVHandle] = []
        self.freed_pages: list[int] = []

    # --- helpers --------------------------------------------------------------------------

    def evicted_anything(self) -> bool:
        c = self.cache.counters
        return bool(c.evicted_pages or sum(c.tombstoned.values()) or c.evicted_checkpoints or c.capped_checkpoints)

    def check_match(self, tokens: tuple[int, ...], namespace: object, match) -> None:
        self.exact.apply(self.cache.events.drain())
        want = self.exact.longest_valid(namespace, tokens)
        assert match.length == want, f"match {match.length}, oracle says {want}"
        ever = self.inserted.longest_valid(namespace, tokens)
        assert match.length <= ever
        if not self.evicted_anything():
            assert match.length == ever
        assert match.full_length == self.exact.longest_full(namespace, tokens)
        assert match.pages.size * self.page_size == match.length
        assert self.cache.residency.owned[match.pages].all()
        assert (match.checkpoint is not None) == (self.cache.rules.checkpoint is not None and match.length > 0)
        assert match.checkpoint_at == (match.full_length if match.full_length > match.length else None)
        each = match.window_lengths
        assert len(each) == len(self.cache.rules.windows) and all(n % self.page_size == 0 for n in each)
        if each:  # each window alone is at least as long as all of them together
            assert match.window_length <= min(each) and max(each) <= match.full_length
            assert len(each) > 1 or each == (match.window_length,)

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    def drop(self, req: Running) -> None:
        """Abort: the manager frees everything the request owns and unlocks."""
        kv = req.kv
        own = kv.own_pages().tolist()
        slots = [*kv.checkpoints.values(), *([kv.state_slot] if kv.state_slot is not None else [])]
        self.released_locks.append(kv.lock)
        self.kvm.release(kv)
        assert kv.status is HandleStatus.RELEASED
        assert not self.mem.pages.live[own].any() and not self.mem.slots.live[slots].any()
        self.freed_pages.extend(own)
        self.released.append(kv)

    @precondition(lambda self: len(self.running) < 4)
    @rule(
        tokens=tokens_st,
        namespace=st.sampled_from(NAMESPACES),
        release_window=st.booleans(),
        ckpt_mask=st.integers(0, 255),
    )
    def start(self, tokens, namespace, release_window, ckpt_mask):
        match = self.kvm.match(np.asarray(tokens, dtype=np.int64), namespace)
        self.check_match(tokens, namespace, match)
        try:
            kv = self.kvm.admit(match, namespace)
        except OutOfMemory:
            assert self.cache.open_locks == len(self.running), "a refused admission kept its lock"
            return
        req = Running(tokens, namespace, kv)
        assert (kv.state_slot is not None) == self.kvm.has_state
        try:
            ps = self.page_size
            wanted = self.kvm.checkpoints.wanted(kv, len(tokens))
            assert all(match.length < p <= len(tokens) and p % ps == 0 for p in wanted)
            for pos in wanted:  # the placement's positions, reserved before prefill reaches them
                self.kvm.checkpoints.reserve(kv, pos)
            first = match.length + ps
            if self.kvm.has_state and ckpt_mask & 1 and first <= len(tokens) and first not in kv.checkpoints:
                self.kvm.extend(kv, match.length + ps)
                self.kvm.checkpoints.take(kv)  # a copy of the running state, now
            self.kvm.extend(kv, len(tokens))
            if self.kvm.has_state:
                positions = range(match.length + ps, self.aligned(len(tokens)) + 1, ps)
                for bit, pos in enumerate(positions):
                    if ckpt_mask >> bit & 1 and pos not in kv.checkpoints:
                        self.kvm.checkpoints.reserve(kv, pos)
        except OutOfMemory:
            self.drop(req)
            return
        if release_window:
            self.kvm.release_windows([kv])
        self.running.append(req)

    def _insert(self, req: Running, final: bool):
        end = self.aligned(len(req.tokens))
        n = end // self.page_size
        row = req.kv.pages[:n].copy()
        checkpoints = dict(req.kv.checkpoints)
        resident = {w.label: self.mem.resident(row, w.pool_id).tolist() for w in self.cache.rules.windows}
        result = self.kvm.insert(req.kv, np.asarray(req.tokens, dtype=np.int64), final=final)
        self.inserted.record_insert(req.namespace, req.tokens[:end], resident, checkpoints)
        assert result.pages.size == n
        assert self.cache.residency.owned[result.pages].all()
        kept = result.pages == row
        assert np.array_equal(np.sort(result.duplicates), np.sort(row[~kept]))
        self.freed_pages.extend(row[~kept].tolist())
        assert not self.mem.pages.live[row[~kept]].any(), "duplicates must be freed by the manager's insert"
        assert not req.kv.checkpoints, "an insert hands every checkpoint up to its end to the cache"
        unused = np.asarray(result.unused_checkpoints, dtype=np.int64)
        assert not self.mem.slots.live[unused].any(), "checkpoints not kept must be freed"
        assert np.array_equal(req.kv.pages[:n], result.pages), "the row must use the cache's ids"
        return result

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def settle(self, data):
        req = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        old = req.kv.lock
        result = self._insert(req, final=False)
        assert req.kv.lock is not old and req.kv.lock.node is result.node and not old.active
        self.released_locks.append(old)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        kv = req.kv
        at = self.kvm.checkpoints.at_finish(kv)
        if at is not None:
            assert at == self.aligned(kv.seq_len) > kv.cached * self.page_size and at not in kv.checkpoints
            with contextlib.suppress(OutOfMemory):  # an optimisation: without room it finishes without it
                self.kvm.checkpoints.reserve(kv, at)
        self._insert(req, final=True)
        assert kv.status is HandleStatus.COMMITTED
        self.refused(CacheError, "committed", self.kvm.extend, kv, len(req.tokens) + 1)
        tail = kv.own_pages().tolist()
        slot = kv.state_slot
        self.released_locks.append(kv.lock)
        self.kvm.release(kv)
        assert not self.mem.pages.live[tail].any() and (slot is None or not self.mem.slots.live[slot])
        self.freed_pages.extend(tail)
        self.released.append(kv)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data):
        self.drop(self.running.pop(data.draw(st.integers(0, len(self.running) - 1))))

    @rule(pool=st.integers(0, 9), count=st.integers(1, 12))
    def evict(self, pool, count):
        names = sorted(self.cache.rules.need_keys, key=str)
        name = names[pool % len(names)]
        before = self.cache.cached_pages
        freed = self.cache.evict({name: count})
        assert all(v > 0 for v in freed.values())
        assert self.cache.cached_pages == before - freed.get(PAGE_NEED, 0)

    @rule(count=st.integers(1, 24))
    def pressure(self, count):
        """An allocation that may have to evict: the tree loses nothing while window-cached
        cells are left to reclaim."""
        c = self.cache.counters
        before = (self.cache.cached_pages, sum(c.tombstoned.values()), c.evicted_checkpoints)
        try:
            pages = self.kvm.alloc_pages(count)
        except OutOfMemory:
            pages = None
        if (self.cache.cached_pages, sum(c.tombstoned.values()), c.evicted_checkpoints) != before:
            assert self.cache.residency.window_cache.total == 0, "the tree lost a value before window-cached cells"
        if pages is not None:
            self.mem.free_pages(pages)

    @precondition(lambda self: not self.running)
    @rule(
        tokens=tokens_st,
        extra=st.lists(st.integers(0, 3), min_size=MAX_CONTEXT, max_size=MAX_CONTEXT),
        length=st.sampled_from([MAX_CONTEXT, MAX_CONTEXT - 1, 40, 17]),
        chunk=st.sampled_from([4, 8, 16]),
        engine_style=st.booleans(),
    )
    def lone_request_fits(self, tokens, extra, length, chunk, engine_style):
        """Alone, a request that fits the budget never runs out of memory: its checkpoints and
        the cache's give way (the engine's flow: a checkpoint at each wanted chunk end, inserted
        at once; or the replay's: every wanted checkpoint reserved at admission)."""
        toks = (tokens + tuple(extra))[:length]
        arr = np.asarray(toks, dtype=np.int64)
        kvm, ps = self.kvm, self.page_size
        kv = kvm.admit(kvm.match(arr[:-1]))  # never OutOfMemory alone
        wanted = kvm.checkpoints.wanted(kv, length)
        if not engine_style:
            for at in wanted:
                with contextlib.suppress(OutOfMemory):  # an optimisation: it goes on without it
                    kvm.checkpoints.reserve(kv, at)
        pos = kv.seq_len
        while pos < length:
            nxt = min(length, pos + chunk, *(p for p in wanted if p > pos))
            kvm.extend(kv, nxt)  # never OutOfMemory alone
            kvm.release_windows([kv])
            pos = nxt
            if engine_style and pos in wanted and pos > kv.cached * ps and pos not in kv.checkpoints:
                with contextlib.suppress(OutOfMemory):
                    kvm.checkpoints.take(kv)
            if engine_style and pos // ps > kv.cached:
                self._insert(Running(toks[:pos], None, kv), final=False)
        at = kvm.checkpoints.at_finish(kv)
        if at is not None:
            with contextlib.suppress(OutOfMemory):
                kvm.checkpoints.reserve(kv, at)
        self._insert(Running(toks, None, kv), final=True)
        self.released_locks.append(kv.lock)
        kvm.release(kv)
        self.released.append(kv)

    @rule(tokens=tokens_st, namespace=st.sampled_from(NAMESPACES))
    def match_only(self, tokens, namespace):
        self.check_match(tokens, namespace, self.cache.match_prefix(list(tokens), namespace))

    # --- bad input: clear error, nothing changed -----------------------------------------

    def refused(self, error, pattern, call, *args, **kwargs):
        mem_before, tree_before = snapshot(self.mem), tree_snapshot(self.cache)
        with pytest.raises(error, match=pattern):
            call(*args, **kwargs)
        assert_unchanged(mem_before, self.mem)
        assert tree_snapshot(self.cache) == tree_before

    @precondition(lambda self: self.released_locks)
    @rule()
    def unlock_twice(self):
        self.refused(LockError, "already unlocked", self.cache.unlock, self.released_locks[-1])

    @precondition(lambda self: self.released)
    @rule()
    def release_twice(self):
        self.refused(CacheError, "released already", self.kvm.release, self.released[-1])

    @precondition(lambda self: self.freed_pages)
    @rule(tokens=tokens_st)
    def insert_freed_page(self, tokens):
        if len(tokens) < self.page_size:
            return
        n = len(tokens) // self.page_size
        pages = np.full(n, self.freed_pages[-1], dtype=np.int64)
        if self.mem.pages.live[pages[0]]:
            return  # the id was handed out again
        self.refused(InsertError, "not allocated", self.cache.insert, list(tokens[: n * self.page_size]), pages)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def insert_wrong_length(self, data):
        req = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        row = req.kv.pages
        tokens = (req.tokens + (0,) * self.page_size)[: row.size * self.page_size + 1]
        self.refused(InsertError, "tokens but", self.cache.insert, list(tokens), row)

    # --- invariants -----------------------------------------------------------------------

    @invariant()
    def running_requests_keep_what_they_need(self):
        for req in self.running:
            kv = req.kv
            assert self.mem.pages.live[kv.pages].all()
            for w in self.cache.rules.windows:
                first = w.pool_id.page_span(kv.seq_len, self.page_size)[0]
                assert w.pool.resident(kv.pages[first:]).all(), f"a running request lost a page of {w.label}"

    @invariant()
    def consistent(self):
        self.mem.verify()
        self.cache.check()
        self.exact.apply(self.cache.events.drain())
        assert_oracle_matches_tree(self.cache, self.exact)

    def teardown(self):
        for req in self.running:
            self.drop(req)
        self.running.clear()
        self.cache.check()
        self.cache.evict({PAGE_NEED: 10**6})
        assert self.cache.cached_pages == 0 and self.cache.num_checkpoints == 0
        self.mem.verify()
        assert self.mem.pages.live_count == 0 and self.mem.slots.live_count == 0, "a page or slot leaked"


SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None)


def _machine(
    preset: str, policy: str, cap: int = 8, placement: str = CacheMachine.placement, budget: int | None = None
) -> type[CacheMachine]:
    attrs = {"preset": preset, "policy": policy, "cap": cap, "placement": placement, "budget": budget}
    return type(f"Machine_{preset}_{policy}", (CacheMachine,), attrs)


TestSwa2State = SETTINGS(_machine("tiny-swa2-state", "lru")).TestCase
TestSwaCost = SETTINGS(_machine("tiny-swa", "cost")).TestCase
TestGdnCostCap = SETTINGS(_machine("tiny-gdn", "cost", cap=2)).TestCase
TestSwa2Lfu = SETTINGS(_machine("tiny-swa2-state", "lfu", cap=3)).TestCase
TestDensePriority = SETTINGS(_machine("tiny-dense", "priority")).TestCase
TestKdaMla = SETTINGS(_machine("tiny-kda-mla", "lru", cap=3)).TestCase
TestPlacementNone = SETTINGS(_machine("tiny-swa2-state", "lru", placement="none")).TestCase
TestPlacementInterval = SETTINGS(_machine("tiny-gdn", "cost", cap=3, placement="interval:8")).TestCase
TestPlacementAligned = SETTINGS(_machine("tiny-swa2-state", "lru", placement="prompt-aligned:8,end")).TestCase
TestPlacementBranch = SETTINGS(_machine("tiny-kda-mla", "lfu", cap=2, placement="branch")).TestCase
TestPlacementAll = SETTINGS(_machine("tiny-gdn", "lru", placement="interval:4,prompt-aligned:8,branch,end")).TestCase


@pytest.mark.parametrize("preset", sorted(FLOORS))
def test_floors_are_the_floors(preset: str) -> None:
    small_memory(preset, budget=FLOORS[preset])
    with pytest.raises(LayoutError, match="Raise the budget"):
        small_memory(preset, budget=FLOORS[preset] - 64)


# at the feasibility floor (``FLOORS``): one request of MAX_CONTEXT tokens fits, little more
TestFloorGdnInterval = SETTINGS(
    _machine("tiny-gdn", "lru", placement="interval:4,end", budget=FLOORS["tiny-gdn"])
).TestCase
TestFloorKdaMla = SETTINGS(
    _machine("tiny-kda-mla", "cost", placement="interval:8", budget=FLOORS["tiny-kda-mla"])
).TestCase
TestFloorSwa2State = SETTINGS(
    _machine("tiny-swa2-state", "lru", placement="interval:4,branch,end", budget=FLOORS["tiny-swa2-state"])
).TestCase
