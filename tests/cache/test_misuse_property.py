"""Property test: random misuse calls, between honest inserts and evictions, are refused with
the package's own error and change nothing.

Misuse: arguments of other types (floats, strings, None, lists, bools), foreign page ids
(never allocated, freed, the sink, negative, out of range, cached at another position),
namespaces never inserted, and frees of ids the cache holds. After every step the memory
and the tree are unchanged by a refused call, and ``cache.check()`` and ``mem.verify()`` hold.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache import PAGE_NEED, CacheError, HybridRadixCache, KVManager
from hybridkv.memory import InvalidIds, MemoryPoolError
from tests.cache.helpers import small_memory, tree_snapshot
from tests.memory.snapshots import assert_unchanged, snapshot

PS = 4
ODD = st.sampled_from([1.5, "2", None, [1], (1, 2), True, b"x", {"a": 1}, object()])


class World:
    def __init__(self) -> None:
        self.mem = small_memory("tiny-swa2-state", PS)
        self.cache = HybridRadixCache(self.mem)
        self.kvm = KVManager(self.cache)
        self.seqs: list[np.ndarray] = []

    def honest_insert(self, stem: int, tail: int) -> None:
        toks = np.concatenate([np.full(8, stem), np.arange(tail * PS) + 100 * stem]).astype(np.int64)
        kv = self.kvm.admit(self.kvm.match(toks[:-1]))
        self.kvm.extend(kv, toks.size)
        self.kvm.finish(kv, toks)
        self.seqs.append(toks)

    def refused(self, errors: tuple[type[Exception], ...], call: Callable[[], object]) -> None:
        mem_before, tree_before, roots = snapshot(self.mem), tree_snapshot(self.cache), set(self.cache.tree.roots)
        try:
            call()
        except errors:
            pass
        else:
            raise AssertionError(f"misuse accepted: {call}")
        assert_unchanged(mem_before, self.mem)
        assert tree_snapshot(self.cache) == tree_before and set(self.cache.tree.roots) == roots

    def cached_pages(self) -> np.ndarray:
        return np.flatnonzero(self.cache.residency.owned)


def misuse(world: World, kind: int, odd: object, pick: int) -> None:
    cache, kvm, mem = world.cache, world.kvm, world.mem
    cached = world.cached_pages()
    own = kvm.alloc_pages(2)
    try:
        toks = np.arange(500, 508)
        free_id = int(mem.pages.free_ids()[pick % mem.pages.free_count])
        foreign = [free_id, 0, -1 - pick, mem.pages.capacity + pick]
        if kind == 0 and odd is not None:  # None: no checkpoints, an honest insert
            world.refused((CacheError,), lambda: cache.insert(toks, own, checkpoints=odd))
        elif kind == 1:
            world.refused((CacheError,), lambda: cache.insert(toks, own, priority=odd))
        elif kind == 2 and not isinstance(odd, bool):  # True is page id 1
            world.refused((CacheError,), lambda: cache.insert(toks, [own[0], odd]))
        elif kind == 3:
            world.refused((CacheError,), lambda: cache.insert(toks, [own[0], foreign[pick % 4]]))
        elif kind == 4 and cached.size:
            other = int(cached[pick % cached.size])
            world.refused((CacheError,), lambda: cache.insert(toks, [own[0], other]))
        elif kind == 5:
            world.refused((CacheError,), lambda: cache.evict(odd))  # type: ignore[arg-type]
        elif kind == 6:
            (full,) = cache.rules.full.pools
            world.refused((CacheError,), lambda: cache.evict({full: odd}))  # type: ignore[dict-item]
        elif kind == 7:
            world.refused((CacheError,), lambda: cache.evict({PAGE_NEED: -1 - pick}))
        elif kind == 8:
            world.refused((CacheError,), lambda: cache.lock(odd))  # type: ignore[arg-type]
        elif kind == 9:
            world.refused((CacheError,), lambda: kvm.extend(odd, 8))  # type: ignore[arg-type]
        elif kind == 10:
            world.refused((CacheError,), lambda: kvm.alloc_pages(odd))  # type: ignore[arg-type]
        elif kind == 11 and cached.size:
            page = cached[pick % cached.size : pick % cached.size + 1]
            world.refused((InvalidIds,), lambda: mem.free_pages(page))
            world.refused((InvalidIds,), lambda: mem.free_pages(np.concatenate([own, page])))
        elif kind == 12 and cache.num_checkpoints:
            slot = next(iter(cache.residency.checkpoint_nodes)).checkpoint
            world.refused((InvalidIds,), lambda: mem.free_state([slot]))
        elif kind == 13:
            roots = set(cache.tree.roots)
            for salt in range(pick % 5 + 1):
                key = ("never", pick, salt)
                assert cache.match_prefix(world.seqs[-1] if world.seqs else toks, key).length == 0
            assert set(cache.tree.roots) == roots
        elif kind == 14:
            world.refused((CacheError, MemoryPoolError), lambda: cache.match_prefix(toks, ["unhashable"]))
    finally:
        mem.free_pages(own)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("insert"), st.integers(0, 3), st.integers(1, 4)),
            st.tuples(st.just("evict"), st.integers(1, 8), st.just(0)),
            st.tuples(st.just("misuse"), st.integers(0, 14), st.integers(0, 50)),
        ),
        min_size=1,
        max_size=25,
    ),
    ODD,
)
def test_random_misuse_is_refused_and_changes_nothing(steps, odd):
    world = World()
    for op, a, b in steps:
        if op == "insert":
            world.honest_insert(a, b)
        elif op == "evict":
            world.cache.evict({PAGE_NEED: a})
        else:
            misuse(world, a, odd, b)
        world.cache.check()
        world.mem.verify()
