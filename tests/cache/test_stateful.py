"""Stateful tests of cache + memory together, against a brute-force oracle.

Requests start (match, lock, allocate, maybe drop out-of-window SWA pages, take state
checkpoints), settle (insert their prompt and relock), finish (insert, free the tail,
unlock) or abort, while the cache evicts on demand and on its own. After every step:
``mem.verify()``, ``cache.check()``, and the event-fed oracle equals the tree. Every match
must equal the event oracle's longest valid hit, never exceed what was ever inserted, and
equal it while nothing was evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.cache import PAGE_NEED, CacheLock, HybridRadixCache, InsertError, LockError, RequestKV
from hybridkv.memory import OutOfMemory
from hybridkv.spec import PoolId
from tests.cache.helpers import assert_oracle_matches_tree, oracle_for, small_memory, tree_snapshot
from tests.memory.snapshots import assert_unchanged, snapshot

STEMS = ((), (1,) * 8, (1,) * 8 + (2,) * 8, (3,) * 12, (1,) * 8 + (2,) * 4 + (0,) * 6)
NAMESPACES = (None, "tenant-b")
tokens_st = st.tuples(st.sampled_from(STEMS), st.lists(st.integers(0, 3), max_size=14)).map(
    lambda t: t[0] + tuple(t[1])
)


@dataclass
class Running:
    tokens: tuple[int, ...]
    namespace: object
    kv: RequestKV
    slot: int | None
    checkpoints: dict[int, int] = field(default_factory=dict)


class CacheMachine(RuleBasedStateMachine):
    preset = "tiny-swa2-state"
    policy = "lru"
    page_size = 4
    cap = 8

    def __init__(self) -> None:
        super().__init__()
        self.mem = small_memory(self.preset, self.page_size)
        self.cache = HybridRadixCache(self.mem, policy=self.policy, max_states_per_path=self.cap, events=True)
        self.exact = oracle_for(self.cache)
        self.inserted = oracle_for(self.cache)
        self.running: list[Running] = []
        self.released_locks: list[CacheLock] = []
        self.freed_pages: list[int] = []

    # --- helpers --------------------------------------------------------------------------

    def evicted_anything(self) -> bool:
        c = self.cache.counters
        return bool(c.evicted_pages or sum(c.tombstoned.values()) or c.evicted_states or c.capped_states)

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
        assert self.cache._owned[match.pages].all()
        assert (match.state is not None) == (self.cache.comps.state is not None and match.length > 0)
        assert match.checkpoint_at == (match.full_length if match.full_length > match.length else None)

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    def drop(self, req: Running) -> None:
        """Abort: free everything the request owns, unlock."""
        own = req.kv.own_pages()
        if own.size:
            self.mem.free_pages(own)
            self.freed_pages.extend(own.tolist())
        slots = [*req.checkpoints.values(), *([req.slot] if req.slot is not None else [])]
        if slots:
            self.mem.free_state(slots)
        self.released_locks.append(req.kv.lock)
        req.kv.unlock()

    # --- rules ----------------------------------------------------------------------------

    @precondition(lambda self: len(self.running) < 4)
    @rule(
        tokens=tokens_st,
        namespace=st.sampled_from(NAMESPACES),
        release_window=st.booleans(),
        ckpt_mask=st.integers(0, 255),
    )
    def start(self, tokens, namespace, release_window, ckpt_mask):
        match = self.cache.match_prefix(np.asarray(tokens, dtype=np.int64), namespace)
        self.check_match(tokens, namespace, match)
        kv = RequestKV(self.cache, match)
        req = Running(tokens, namespace, kv, None)
        try:
            pages = self.cache.alloc_pages(kv.pages_needed(len(tokens)))
            kv.extend(len(tokens), pages)
            if self.cache.comps.state is not None:
                if match.state is not None:
                    req.slot = int(self.cache.fork_state([match.state])[0])
                else:
                    req.slot = int(self.cache.alloc_state(1)[0])
                ps = self.page_size
                positions = range(match.length + ps, self.aligned(len(tokens)) + 1, ps)
                for bit, pos in enumerate(positions):
                    if ckpt_mask >> bit & 1:
                        req.checkpoints[pos] = int(self.cache.alloc_state(1)[0])
        except OutOfMemory:
            self.drop(req)
            return
        if release_window:
            for w, pages in zip(self.cache.comps.windows, kv.window_release(), strict=True):
                if pages.size:
                    self.mem.free_window_pages(pages, w.pool_id)
        self.running.append(req)

    def _insert(self, req: Running):
        end = self.aligned(len(req.tokens))
        n = end // self.page_size
        row = req.kv.pages[:n].copy()
        resident = {str(w.pool_id): self.mem.resident(row, w.pool_id).tolist() for w in self.cache.comps.windows}
        result = self.cache.insert(
            np.asarray(req.tokens[:end], dtype=np.int64),
            row,
            extra_key=req.namespace,
            states=req.checkpoints,
        )
        self.inserted.record_insert(req.namespace, req.tokens[:end], resident, req.checkpoints)
        assert result.pages.size == n
        assert self.cache._owned[result.pages].all()
        kept = result.pages == row
        assert result.freed_pages == int(np.count_nonzero(~kept))
        self.freed_pages.extend(row[~kept].tolist())
        assert not self.mem.pages.live[row[~kept]].any(), "duplicates must be freed by insert"
        req.checkpoints = {}
        return result

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def settle(self, data):
        req = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        self.released_locks.append(req.kv.lock)
        req.kv.settle(self._insert(req))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self._insert(req)
        tail = req.kv.pages[self.aligned(len(req.tokens)) // self.page_size :]
        if tail.size:
            self.mem.free_pages(tail)
        if req.slot is not None:
            self.mem.free_state([req.slot])
        self.released_locks.append(req.kv.lock)
        req.kv.unlock()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data):
        self.drop(self.running.pop(data.draw(st.integers(0, len(self.running) - 1))))

    @rule(pool=st.integers(0, 9), count=st.integers(1, 12))
    def evict(self, pool, count):
        names = [*sorted(self.cache.comps.pool_ids, key=PoolId.sort_key), PAGE_NEED]
        name = names[pool % len(names)]
        before = self.cache.cached_pages
        freed = self.cache.evict({name: count})
        assert all(v > 0 for v in freed.values())
        assert self.cache.cached_pages == before - freed.get(PAGE_NEED, 0)

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
        assert self.cache.cached_pages == 0 and self.cache.num_states == 0
        self.mem.verify()
        assert self.mem.pages.live_count == 0 and self.mem.slots.live_count == 0, "a page or slot leaked"


SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None)


def _machine(preset: str, policy: str, cap: int = 8) -> type[CacheMachine]:
    return type(f"Machine_{preset}_{policy}", (CacheMachine,), {"preset": preset, "policy": policy, "cap": cap})


TestSwa2State = SETTINGS(_machine("tiny-swa2-state", "lru")).TestCase
TestSwaCost = SETTINGS(_machine("tiny-swa", "cost")).TestCase
TestGdnCostCap = SETTINGS(_machine("tiny-gdn", "cost", cap=2)).TestCase
TestSwa2Lfu = SETTINGS(_machine("tiny-swa2-state", "lfu", cap=3)).TestCase
TestDensePriority = SETTINGS(_machine("tiny-dense", "priority")).TestCase
TestKdaMla = SETTINGS(_machine("tiny-kda-mla", "lru", cap=3)).TestCase
