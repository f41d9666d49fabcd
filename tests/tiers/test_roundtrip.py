"""Real KV and state bytes of tiny Qwen3-Next (GQA + GatedDeltaNet) and Gemma 3 (full +
sliding window) memories go out to each tier when the device evicts them and come back into
fresh pages and a fresh state slot byte-exact, read through every layer's view."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.cache import PAGE_NEED
from hybridkv.tiers import DictStore, HostTier, TierHierarchy, Where, WritePolicy, device_view
from hybridkv.tiers.framing import HEADER
from tests.tiers.helpers import TINY, new_cache, serve, tiny_memory, view_bytes

BELOW = ("host", "dict", "mooncake", "host+mooncake")


def _hierarchy(cache, below: str, request: pytest.FixtureRequest, policy: str = "back") -> TierHierarchy:
    host = store = None
    if below.startswith("host"):
        # with a store below, host memory holds a few objects only: most cascade on to the store
        host = HostTier(3 * (HEADER + max(cache.mem.layout(p).cell_bytes for p in cache.mem.pools)))
        if below == "host":
            host = HostTier(1 << 20)
    if below == "dict":
        store = DictStore()
    if below.endswith("mooncake"):
        store = request.getfixturevalue("mooncake_store")
    return TierHierarchy(cache, host=host, store=store, policy=policy)


def _scramble(mem) -> None:
    """New random bytes everywhere: what comes back must have been copied in."""
    gen = torch.Generator().manual_seed(99)
    mem.arena.buffer.copy_(torch.randint(0, 256, mem.arena.buffer.shape, dtype=torch.uint8, generator=gen))


@pytest.mark.parametrize("below", BELOW)
@pytest.mark.parametrize("model", TINY)
def test_evicted_prefix_comes_back_byte_exact(model, below, request):
    mem = tiny_memory(model)
    cache, kvm = new_cache(mem)
    tiers = _hierarchy(cache, below, request)
    tokens = np.arange(40, dtype=np.int64)
    serve(kvm, tokens, fill=1)
    dev = device_view(cache, tokens)
    assert dev.pages.size == 10
    before = view_bytes(mem, dev.pages, dev.checkpoints.get(10))
    cache.evict({PAGE_NEED: 10_000})
    assert cache.cached_tokens == 0
    tiers.reap(wait=True)
    _scramble(mem)

    prefix = np.concatenate([tokens, np.arange(100, 107)])  # a next turn: its hit may end at 40
    match = kvm.match(prefix)
    assert match.length == 0
    plan = tiers.plan(prefix, None, match.length)
    assert plan.tokens == 40
    sources = {p.where for p in plan.pieces}
    assert Where.DEVICE not in sources
    if below == "host+mooncake":
        assert sources == {Where.HOST, Where.STORE}  # some in host memory, the rest cascaded on
    fetched = tiers.fetch(plan)
    kv = kvm.admit(match)
    kvm.extend(kv, plan.tokens)
    assert tiers.commit(fetched, kv.pages, kv.state_slot) == 40
    after = view_bytes(mem, kv.pages, kv.state_slot)
    # full KV of every page, the state, and the window before the hit's end (8 tokens: pages 8, 9)
    expected = {k: v for k, v in before.items() if not k[0].startswith("swa") or k[3] in (8, 9)}
    assert any(k[0].startswith("swa") for k in expected) == (model == "tiny-gemma3")
    assert expected.keys() <= after.keys()
    for key, data in expected.items():
        assert after[key] == data, f"bytes differ at {key}"
    assert any(k[3] == -1 for k in expected) == (cache.rules.checkpoint is not None)
    kvm.release_windows([kv])
    kvm.finish(kv, prefix[:40])  # the restored pages and state become the device's again
    mem.verify()
    cache.check()
    tiers.close()


@pytest.mark.parametrize("model", TINY)
def test_write_through_stores_at_insert(model, request):
    mem = tiny_memory(model)
    cache, kvm = new_cache(mem)
    tiers = _hierarchy(cache, "host+mooncake", request, policy=WritePolicy.THROUGH)
    serve(kvm, np.arange(40, dtype=np.int64), fill=3)
    tiers.reap(wait=True)
    c = tiers.counters
    assert c.written_objects["host"] > 0 and c.written_objects["mooncake"] >= c.written_objects["host"]
    written = dict(c.written_objects)
    cache.evict({PAGE_NEED: 10_000})  # nothing more to write: every tier has it
    tiers.reap(wait=True)
    assert dict(c.written_objects) == written
    plan = tiers.plan(np.arange(47, dtype=np.int64), None, 0)
    assert plan.tokens == 40
    tiers.close()
