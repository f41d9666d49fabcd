"""The hierarchy's rules: keys agree with the cache's own page names and never cross layouts
or namespaces; a corrupted or silently evicted object makes the restore fall back to the
device (the reason counted), never wrong bytes; pieces the device still holds past its own
hit are used in place (pinned, copied device to device); write-back cascades device ->
host -> store."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import PAGE_NEED
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import Parallel, ShardSpec
from hybridkv.tiers import DictStore, HostTier, KeySpace, PutStatus, TierError, TierHierarchy, Where
from hybridkv.tiers.framing import HEADER
from tests.tiers.helpers import new_cache, serve, tiny_memory, tiny_spec, view_bytes

TOKENS = np.arange(40, dtype=np.int64)
NEXT = np.concatenate([TOKENS, np.arange(100, 107)])  # a next turn's prefix: a hit may end at 40


def _restore(tiers: TierHierarchy, kvm, prefix: np.ndarray) -> tuple[int, object]:
    match = kvm.match(prefix)
    plan = tiers.plan(prefix, None, match.length)
    fetched = tiers.fetch(plan)
    kv = kvm.admit(match)
    kvm.extend(kv, plan.tokens)
    end = tiers.commit(fetched, kv.pages, kv.state_slot)
    tiers.record(plan, end)
    return end, kv


def test_keys_are_the_caches_own_page_names():
    mem = tiny_memory("tiny-qwen3-next")
    cache, kvm = new_cache(mem)
    stored = []

    class Spy:
        def stored(self, node, kind, pool):
            stored.append(node)

        def evicting(self, node, kind, pool):
            pass

    cache.set_residency_hook(Spy())
    serve(kvm, TOKENS, fill=1)
    assert stored
    names = [h for node in cache.match_prefix(TOKENS).node.path() for h in node.hashes]
    keys = KeySpace.of(mem)
    assert keys.page_names(TOKENS) == names and len(names) == 10
    assert keys.page_names(TOKENS, "tenant") != names  # a namespace names pages apart


def test_layouts_never_share_keys():
    """Different TP ranks, TP sizes, models or page sizes: no prefix in common."""
    prefixes = set()
    for name, tp, rank, ps in [
        ("tiny-qwen3-next", 1, 0, 4),
        ("tiny-qwen3-next", 2, 0, 4),
        ("tiny-qwen3-next", 2, 1, 4),
        ("tiny-qwen3-next", 1, 0, 8),
        ("tiny-gemma3", 1, 0, 4),
    ]:
        mem = tiny_memory(name, tp=tp, tp_rank=rank, page_size=ps)
        mine = set(KeySpace.of(mem).prefixes.values())
        assert len(mine) == len(mem.pools) and not mine & prefixes
        prefixes |= mine


def test_another_shard_finds_nothing_of_ours():
    store = DictStore()
    mem = tiny_memory("tiny-qwen3-next", tp=2, tp_rank=0)
    cache, kvm = new_cache(mem)
    TierHierarchy(cache, store=store)
    serve(kvm, TOKENS, fill=1)
    cache.evict({PAGE_NEED: 10_000})
    assert len(store) > 0
    other = tiny_memory("tiny-qwen3-next", tp=2, tp_rank=1)
    other_cache, _ = new_cache(other)
    assert TierHierarchy(other_cache, store=store).plan(NEXT, None, 0).tokens == 0
    same = tiny_memory("tiny-qwen3-next", tp=2, tp_rank=0)
    same_cache, _ = new_cache(same)
    assert TierHierarchy(same_cache, store=store).plan(NEXT, None, 0).tokens == 40  # same layout: shared


@pytest.mark.parametrize("below", ["dict", "mooncake"])
@pytest.mark.parametrize("damage", ["corrupt", "silently evicted"])
def test_a_damaged_object_is_a_counted_miss_and_the_request_recomputes(damage, below, request):
    mem = tiny_memory("tiny-qwen3-next")
    cache, kvm = new_cache(mem)
    store = DictStore() if below == "dict" else request.getfixturevalue("mooncake_store")
    tiers = TierHierarchy(cache, store=store)
    serve(kvm, TOKENS, fill=1)
    cache.evict({PAGE_NEED: 10_000})
    tiers.reap(wait=True)
    plan = tiers.plan(NEXT, None, 0)
    assert plan.tokens == 40
    state = next(p for p in plan.pieces if p.pool == tiers.state_pool)
    key, size = state.keys[0], tiers.keys.payload_bytes[state.pool]
    if damage == "corrupt":  # flip a byte of the stored state through the store's own API
        if isinstance(store, DictStore):
            bad = store._read([key], [HEADER + size])[0].clone()
            bad[HEADER + size // 2] ^= 1
            store.evict([key])
            assert store.put([key], [bad]) == [PutStatus.STORED]
        else:
            blob = bytearray(store._store.get(key))
            blob[HEADER + size // 2] ^= 1
            assert store._store.upsert(key, bytes(blob)) == 0
    else:  # the store dropped it on its own after the plan saw it
        assert store.evict([key]) == 1
    match = kvm.match(NEXT)
    fetched = tiers.fetch(plan)
    kv = kvm.admit(match)
    kvm.extend(kv, plan.tokens)
    assert tiers.commit(fetched, kv.pages, kv.state_slot) == 0
    assert tiers.counters.fallbacks == 1
    assert tiers.counters.misses == {"checksum" if damage == "corrupt" else "evicted": 1}
    kvm.release(kv)
    mem.verify()
    cache.check()
    tiers.close()


def test_state_evicted_but_kv_kept_uses_the_devices_kv_and_a_host_checkpoint():
    """The device keeps the full KV but lost its checkpoints: the hit comes back with the KV
    copied on the device (pinned meanwhile) and the state from host memory."""
    mem = tiny_memory("tiny-qwen3-next")
    cache, kvm = new_cache(mem)
    tiers = TierHierarchy(cache, host=HostTier(1 << 20))
    serve(kvm, TOKENS, fill=1)
    pages = cache.match_prefix(TOKENS).pages.copy()
    slot40 = next(n.checkpoint for n in cache.match_prefix(TOKENS).node.path() if n.end == 40)
    before = view_bytes(mem, pages, slot40)
    cache.evict({tiers.state_pool: 100})
    assert cache.num_checkpoints == 0 and cache.cached_tokens == 40
    match = kvm.match(NEXT)
    assert match.length == 0 and match.full_length == 40
    plan = tiers.plan(NEXT, None, match.length)
    assert plan.tokens == 40
    assert {(str(p.pool), p.where) for p in plan.pieces} == {("full", Where.DEVICE), ("state", Where.HOST)}
    fetched = tiers.fetch(plan)
    assert mem.gates.page_pins[pages].all()  # the device's pages past the hit cannot move or go
    kv = kvm.admit(match)
    kvm.extend(kv, plan.tokens)
    assert tiers.commit(fetched, kv.pages, kv.state_slot) == 40
    tiers.record(plan, 40)
    assert not mem.gates.page_pins[pages].any()
    after = view_bytes(mem, kv.pages, kv.state_slot)
    for key, data in before.items():
        assert after[key] == data, key
    assert tiers.counters.loaded_bytes["device"] > 0 and tiers.counters.loaded_bytes["host"] > 0
    assert tiers.counters.hit_tokens["checkpoint"] == {"host": 40}
    kvm.release(kv)
    mem.verify()
    cache.check()


def test_write_back_cascades_to_the_store():
    """Host memory holding a few objects: what it evicts goes on to the store, and a hit
    is restored from both."""
    mem = tiny_memory("tiny-gemma3")
    cache, kvm = new_cache(mem)
    cell = HEADER + max(mem.layout(p).cell_bytes for p in mem.pools)
    host, store = HostTier(4 * cell), DictStore()
    tiers = TierHierarchy(cache, host=host, store=store)
    serve(kvm, TOKENS, fill=1)
    cache.evict({PAGE_NEED: 10_000})
    assert host.evictions > 0 and len(store) == host.evictions
    assert tiers.counters.written_objects["dict"] == host.evictions
    match = kvm.match(NEXT)
    plan = tiers.plan(NEXT, None, match.length)
    kv = kvm.admit(match)
    kvm.extend(kv, plan.tokens)
    end = tiers.commit(tiers.fetch(plan), kv.pages, kv.state_slot)
    tiers.record(plan, end)
    assert end == 40
    details = plan.cached_tokens(end)  # the server's cached_tokens_details
    assert details["host"] > 0 and details["storage"] > 0 and sum(details.values()) == 40
    assert tiers.counters.hit_tokens["full_kv"] == {"host": details["host"], "store": details["storage"]}
    assert plan.cached_tokens(0) == {"device": 0, "host": 0, "storage": 0}
    kvm.release(kv)


def test_misuse_is_refused():
    mem = tiny_memory("tiny-qwen3-next")
    cache, kvm = new_cache(mem)
    with pytest.raises(TierError, match="host memory, a store"):
        TierHierarchy(cache)
    serve(kvm, TOKENS, fill=1)
    with pytest.raises(Exception, match="before the first insert"):
        TierHierarchy(cache, store=DictStore())
    fresh, fresh_kvm = new_cache(tiny_memory("tiny-qwen3-next"))
    tiers = TierHierarchy(fresh, store=DictStore())
    plan = tiers.plan(NEXT, None, 0)
    kv = fresh_kvm.admit(fresh_kvm.match(NEXT))
    assert tiers.commit(tiers.fetch(plan), kv.pages, kv.state_slot) == 0  # nothing below: the device hit
    assert tiers.counters.fallbacks == 0 and not tiers.counters.misses


@pytest.mark.parametrize(("stride", "pages"), [(0, {8, 9}), (16, {2, 3, 6, 7, 8, 9}), (8, set(range(10)))])
def test_window_stride_writes_the_windows_before_more_boundaries(stride, pages):
    """Gemma 3's window is 8 tokens (2 pages): a 40-token node writes the window before its end,
    and with a stride the windows before every multiple of it; a hit can then end there."""
    mem = tiny_memory("tiny-gemma3")
    cache, kvm = new_cache(mem)
    store = DictStore()
    tiers = TierHierarchy(cache, store=store, window_stride=stride)
    serve(kvm, TOKENS, fill=1)
    names = tiers.keys.page_names(TOKENS)
    cache.evict({PAGE_NEED: 10_000})
    window = tiers.window_pools[0]
    held = store.exists(tiers.keys.keys(window, names))
    assert set(np.flatnonzero(held).tolist()) == pages
    diverging = np.concatenate([TOKENS[:16], np.arange(200, 220)])  # leaves the cached tokens at 16
    assert tiers.plan(diverging, None, 0).tokens == (16 if stride else 0)


@pytest.mark.parametrize(("align", "pages", "hit"), [(0, {8, 9}, 0), (16, {6, 7}, 32), (24, {4, 5}, 24)])
def test_window_align_writes_the_window_before_the_aligned_end(align, pages, hit):
    """A 40-token node with ``window_align`` writes the window (2 pages) before its end rounded down
    to a multiple of it instead of before its end: a later prompt sharing only whole blocks of that
    many tokens hits there."""
    cache, kvm = new_cache(tiny_memory("tiny-gemma3"))
    store = DictStore()
    tiers = TierHierarchy(cache, store=store, window_align=align)
    serve(kvm, TOKENS, fill=1)
    names = tiers.keys.page_names(TOKENS)
    cache.evict({PAGE_NEED: 10_000})
    held = store.exists(tiers.keys.keys(tiers.window_pools[0], names))
    assert set(np.flatnonzero(held).tolist()) == pages
    diverging = np.concatenate([TOKENS[: hit or 32], np.arange(200, 220)])
    assert tiers.plan(diverging, None, 0).tokens == hit


@pytest.mark.parametrize("option", ["window_stride", "window_align"])
def test_window_boundaries_must_be_whole_pages(option):
    cache, _ = new_cache(tiny_memory("tiny-gemma3"))
    with pytest.raises(TierError, match=f"{option} must be 0 or a positive multiple of the page size"):
        TierHierarchy(cache, store=DictStore(), **{option: 6})


def test_writes_a_tier_finishes_at_once_are_never_a_backlog():
    """The backlog bound is for unfinished writes only: a batch bigger than it, to a tier that
    completes it at once, is written whole."""
    cache, kvm = new_cache(tiny_memory("tiny-qwen3-next"))
    store = DictStore()
    tiers = TierHierarchy(cache, store=store, max_pending_bytes=1)
    serve(kvm, TOKENS, fill=1)
    cache.evict({PAGE_NEED: 10_000})
    assert not tiers.counters.write_refused and tiers.pending_bytes == 0
    assert tiers.counters.written_objects["dict"] == len(store) > 10


def test_pipeline_stages_never_share_keys():
    """A disaggregated prefill engine's PP stages (x TP ranks) and a single engine: no prefix in common;
    the same shard built twice names the same prefixes (what lets two servers of one layout share)."""
    spec = tiny_spec("tiny-qwen3-next")

    def prefixes(pp: int, tp: int, stage: int, rank: int) -> set[str]:
        shard = ShardSpec(spec, Parallel(pp_size=pp, tp_size=tp), stage, rank)
        mem = UnifiedMemory.create(shard, 400_000, page_size=4, max_context=128, chunk_tokens=16)
        return set(KeySpace.of(mem).prefixes.values())

    seen = set(KeySpace.of(tiny_memory("tiny-qwen3-next")).prefixes.values())
    for pp, tp, stage, rank in [(2, 1, 0, 0), (2, 1, 1, 0), (2, 2, 0, 0), (2, 2, 0, 1), (2, 2, 1, 1), (3, 1, 0, 0)]:
        mine = prefixes(pp, tp, stage, rank)
        assert mine and not mine & seen, (pp, tp, stage, rank)
        assert prefixes(pp, tp, stage, rank) == mine
        seen |= mine
