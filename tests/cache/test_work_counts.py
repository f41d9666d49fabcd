"""Work that must not grow with what it does not touch, counted in lines of cache code
executed (never timed): the per-path cap's work per insert grows linearly with the
checkpoints it attaches, not with checkpoints x path depth; an eviction does not pop again
the leaves running requests lock."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED, HybridRadixCache, KVManager
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import ShardSpec, get_preset

PS = 4
CACHE_CODE = "/hybridkv/cache/"


def lines_run(call: Any) -> int:
    """Lines of ``hybridkv.cache`` code that ``call()`` executes."""
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if CACHE_CODE not in frame.f_code.co_filename:
            return None  # no line events outside the cache package
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def insert_work(positions: int, cap: int) -> tuple[int, HybridRadixCache]:
    """Lines executed by one insert of ``positions`` pages with a checkpoint at every page end,
    below a cached prefix that already holds a checkpoint (a locked hit's, as a request's)."""
    mem = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-gdn")), 40_000_000, "cpu", page_size=PS, max_context=4096, chunk_tokens=64
    )
    cache = HybridRadixCache(mem, max_checkpoints_per_path=cap)
    kvm = KVManager(cache)
    prefix = np.arange(8 * PS)
    first = cache.insert(prefix, kvm.alloc_pages(8), checkpoints={8 * PS: int(kvm.alloc_state(1)[0])})
    lock = cache.lock(first.node)
    toks = np.arange((8 + positions) * PS)
    row = np.concatenate([first.pages, kvm.alloc_pages(positions)])
    slots = kvm.alloc_state(positions)
    ckpts = {(8 + i + 1) * PS: int(s) for i, s in enumerate(slots)}
    result: list[Any] = []
    work = lines_run(lambda: result.append(cache.insert(toks, row, checkpoints=ckpts)))
    mem.free_state(result[0].unused_checkpoints)
    cache.unlock(lock)
    cache.check()
    mem.verify()
    assert cache.num_checkpoints == min(cap, positions + 1)
    return work, cache


@pytest.mark.parametrize("cap", [4, 1000])
def test_insert_work_is_linear_in_its_checkpoints(cap):
    """Quadrupling the checkpoints of one insert (each one node deeper than the last) at most
    quadruples its work, plus slack: a walk of the path per checkpoint (the cap's count of the
    checkpoints above, the ancestors' counts, the victims) would multiply it by about 16."""
    small, _ = insert_work(64, cap)
    large, cache = insert_work(256, cap)
    assert large <= 5 * small, f"{small} lines for 64 checkpoints, {large} for 256"
    deepest = cache.match_prefix(np.arange((8 + 256) * PS)).node
    assert deepest.end == (8 + 256) * PS and deepest.checkpoint >= 0  # the deepest is always kept


def test_locked_leaves_are_popped_once_until_an_unlock():
    """Many running requests lock the least recently used leaves: the first eviction skips
    them and parks them; later evictions (no unlock in between) cost the same however many
    are locked; an unlock brings them back, and the unlocked one is evicted in LRU order."""
    mem = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-dense")), 8_000_000, "cpu", page_size=PS, max_context=256, chunk_tokens=64
    )

    def evictions_work(locked: int) -> tuple[int, HybridRadixCache]:
        cache = HybridRadixCache(mem)
        kvm = KVManager(cache)
        locks = []
        for i in range(locked + 40):  # the locked ones first: least recently used
            result = cache.insert(np.arange(4 * PS) + 1000 * i, kvm.alloc_pages(4))
            if i < locked:
                locks.append(cache.lock(result.node))
        cache.evict({PAGE_NEED: 4})  # parks every locked leaf
        assert len(cache.residency.full_heap.parked) == locked
        cache.check()
        work = lines_run(lambda: [cache.evict({PAGE_NEED: 4}) for _ in range(20)])
        cache.check()
        cache.unlock(locks[0])  # the least recently used leaf is evictable again: it goes first
        cache.evict({PAGE_NEED: 4})
        assert cache.match_prefix(np.arange(4 * PS)).length == 0 and cache.num_nodes == locked + 18
        cache.check()
        for lock in locks[1:]:
            cache.unlock(lock)
        cache.evict({PAGE_NEED: cache.cached_pages})
        assert cache.num_nodes == 0
        mem.verify()
        return work, cache

    few, _ = evictions_work(4)
    many, cache = evictions_work(200)
    assert many <= 1.5 * few, f"20 evictions: {few} lines with 4 locked leaves, {many} with 200"
    leaf = cache.insert(np.arange(4 * PS), KVManager(cache).alloc_pages(4)).node
    cache.residency.full_heap.park(leaf, cache.locks.unlocks)  # parked, but no lock holds it
    with pytest.raises(AssertionError, match="parked as locked but no lock holds it"):
        cache.check()


def test_evicting_a_checkpointed_path_bottom_up_is_linear():
    """A path of n nodes, each with a checkpoint, evicted one leaf at a time (as a prefill
    short of a few pages does): every removal lowers the count of every node above it, but
    the counts are brought up to date once, when read, so the work is O(n), not O(n^2)."""

    def work(positions: int) -> int:
        _, cache = insert_work(positions, 1000)
        mem = cache.mem
        total = 0
        while cache.num_nodes > 1:  # the prefix's node stays: one leaf at a time
            total += lines_run(lambda: cache.evict({PAGE_NEED: 1}))
        cache.check()
        mem.verify()
        return total

    small, large = work(64), work(256)
    assert large <= 5 * small, f"{small} lines for a path of 64 checkpoints, {large} for 256"
