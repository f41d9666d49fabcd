"""The cache's hot path (match, lock, insert with dedupe and window recovery, evict, fork)
never reads device memory: its ids live on the host."""

from __future__ import annotations

import numpy as np

from hybridkv.cache import HybridRadixCache, RequestKV
from hybridkv.host_sync import HostSyncCounter
from hybridkv.spec import FULL_POOL, RECURRENT_POOL, WindowPool
from tests.cache.helpers import small_memory

PS = 4


def test_hot_path_makes_no_host_sync():
    cache = HybridRadixCache(small_memory("tiny-swa2-state", PS), policy="cost")
    mem = cache.mem
    rng = np.random.default_rng(0)
    with HostSyncCounter() as syncs:
        for i in range(40):
            toks = np.concatenate([np.arange(16), rng.integers(0, 3, size=int(rng.integers(4, 24)))])
            match = cache.match_prefix(toks, extra_key=i % 2)
            kv = RequestKV(cache, match)
            kv.extend(toks.size, cache.alloc_pages(kv.pages_needed(toks.size)))
            slot = cache.fork_state([match.state]) if match.state is not None else cache.alloc_state(1)
            for w, pages in zip(cache.comps.windows, kv.window_release(), strict=True):
                if pages.size:
                    mem.free_window_pages(pages, w.pool_id)
            end = toks.size - toks.size % PS
            ckpt = {end: int(cache.alloc_state(1)[0])} if end > match.length else {}
            kv.settle(cache.insert(toks[:end], kv.pages[: end // PS], extra_key=i % 2, states=ckpt))
            if kv.own_pages().size:
                mem.free_pages(kv.own_pages())
            mem.free_state(slot)
            kv.unlock()
            if i % 7 == 6:
                cache.evict({WindowPool(8): 3, RECURRENT_POOL: 2, FULL_POOL: 2})
            mem.flush_tables()
    assert syncs.total == 0, dict(syncs.counts)
    assert cache.counters.inserts == 40 and cache.counters.matches == 40
    cache.check()
    mem.verify()
