"""The cache's hot path (match, lock, insert with dedupe and window recovery, window-cached
release and its reclaim under pressure, evict, fork) never reads device memory: its ids live
on the host (on ``HYBRIDKV_TEST_DEVICE``, ``tests/devices.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import HybridRadixCache, KVManager
from tests.cache.helpers import small_memory
from tests.devices import device, no_host_sync

PS = 4


@pytest.mark.host_sync
def test_hot_path_makes_no_host_sync():
    cache = HybridRadixCache(small_memory("tiny-swa2-state", PS, device=device()), policy="cost")
    kvm = KVManager(cache)
    mem = cache.mem
    rules = cache.rules
    assert rules.checkpoint is not None
    needs = {rules.windows[0].pool_id: 3, rules.checkpoint.pool_id: 2, rules.full.pools[0]: 2}
    rng = np.random.default_rng(0)
    with no_host_sync() as syncs:
        for i in range(40):
            toks = np.concatenate([np.arange(16), rng.integers(0, 3, size=int(rng.integers(4, 24)))])
            match = kvm.match(toks, i % 2)
            kv = kvm.admit(match, i % 2)  # forks the hit's checkpoint, or a fresh state slot
            kvm.extend(kv, toks.size)
            kvm.release_windows([kv])
            end = toks.size - toks.size % PS
            if end > match.length:
                kvm.checkpoints.reserve(kv, end)
            kvm.insert(kv, toks)
            kvm.release(kv)
            if i % 7 == 6:
                cache.evict(needs)
            mem.flush_tables()
        # a running request's window-cached pages, reclaimed by an allocation under pressure
        toks = 500 + np.arange(60)
        kv = kvm.admit(kvm.match(toks))
        kvm.extend(kv, toks.size)
        kvm.release_windows([kv])
        held = cache.residency.window_cache.total
        taken = []
        while cache.residency.window_cache.total:
            taken.append(kvm.alloc_pages(1))
        mem.free_pages(np.concatenate(taken))
        kvm.release(kv)
        mem.flush_tables()
    assert syncs.total == 0, dict(syncs.counts)
    assert held and sum(cache.counters.reclaimed.values()) >= held
    assert cache.counters.inserts == 40 and cache.counters.matches == 41
    cache.check()
    mem.verify()
