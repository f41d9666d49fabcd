"""The engine over tiers below its device: a prefix evicted from the device comes back from host
memory, then (host emptied too) from the real Mooncake Store, and the tokens stay exactly
transformers' for every architecture; a damaged or silently evicted store object is a miss
(the request recomputes, still exact); a restore never leaves garbage window cells behind."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.sched.request import Outcome
from hybridkv.host_sync import HostSyncCounter
from hybridkv.tiers import MooncakeMaster, MooncakeStoreTier, TierHierarchy, base, hierarchy, mooncake_store
from hybridkv.tiers.framing import HEADER
from tests.engine.harness import hf_model, hf_reference, live_counts, prompt

ALL_MODELS = ["tiny-qwen3-next", "tiny-gemma3", "tiny-gpt-oss", "tiny-nemotron-h", "tiny-kimi-linear"]
A = prompt(300, 41)
NEW = 6


def turn(seed: int, keep: int = 40, extra: int = 5) -> list[int]:
    """A prompt that shares ``A``'s first ``keep`` tokens and then leaves it."""
    tail = prompt(seed, extra)
    tail[0] = 3 if A[keep] != 3 else 4
    return A[:keep] + tail


def engine(name: str, **tiers: Any) -> Engine:
    hf = hf_model(name)
    return Engine(hf.config, hf, EngineConfig(gpu_memory=400_000, page_size=4, chunk_size=8, max_context=96, **tiers))


@pytest.fixture
def salt() -> str:
    """A cache namespace of its own: the tests share the session's store."""
    return uuid.uuid4().hex


def run(e: Engine, name: str, ids: list[int], salt: str) -> Outcome:
    out = e.generate([ids], NEW, cache_salts=[salt])[0]
    assert out.error is None
    assert out.output_ids == hf_reference(name, tuple(ids), NEW)[0], f"{name}: tokens differ"
    assert sum(out.cached_tokens_details.values()) == out.cached_tokens
    return out


def store_of(e: Engine) -> MooncakeStoreTier:
    assert e.tiers is not None and isinstance(e.tiers.hierarchy.store, MooncakeStoreTier)
    return e.tiers.hierarchy.store


def first_key(e: Engine, ids: list[int], salt: str) -> tuple[str, int]:
    """The store key and payload size of page 0's full KV of ``ids`` (the first full pool)."""
    assert e.tiers is not None
    h: TierHierarchy = e.tiers.hierarchy
    pool = h.full_pools[0]
    return h.keys.keys(pool, h.keys.page_names(np.asarray(ids[:4]), salt))[0], h.keys.payload_bytes[pool]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_an_evicted_prefix_comes_back_from_host_then_from_the_store(name, mooncake_master, salt):
    e = engine(name, host_memory="8MiB", store="mooncake", store_master=mooncake_master.address, store_memory="32MiB")
    try:
        empty = live_counts(e.mem)
        assert run(e, name, A, salt).cached_tokens == 0
        e.clear_cache()  # device -> host
        assert live_counts(e.mem) == empty and e.cache.cached_tokens == 0
        host = run(e, name, turn(1), salt)
        assert host.cached_tokens_details == {"device": 0, "host": 40, "storage": 0}
        e.clear_cache(host=True)  # device -> host -> the Mooncake Store
        assert e.tiers is not None and e.tiers.hierarchy.host is not None and len(e.tiers.hierarchy.host) == 0
        stored = run(e, name, turn(2), salt)
        assert stored.cached_tokens_details == {"device": 0, "host": 0, "storage": 40}
        again = run(e, name, turn(3), salt)  # the restored pages and state are the device's again
        assert again.cached_tokens_details == {"device": 40, "host": 0, "storage": 0}
        m = e.metrics()
        assert m["cached_tokens_host"] == 40 and m["cached_tokens_storage"] == 40 and m["cached_tokens_device"] == 40
        assert m["tiers"]["restored_requests"] == 2 and not m["tiers"]["misses"]
        e.mem.verify()
        e.cache.check()
        e.clear_cache()
        assert live_counts(e.mem) == empty
    finally:
        e.close()


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3-next"])
def test_a_damaged_store_object_is_a_miss_and_the_request_recomputes(name, mooncake_master, salt):
    e = engine(name, store="mooncake", store_master=mooncake_master.address, store_memory="32MiB")
    try:
        run(e, name, A, salt)
        e.clear_cache()  # no host tier: device -> store
        key, size = first_key(e, A, salt)
        raw = store_of(e)._store  # the Mooncake client itself: read the object, flip a byte, upsert
        blob = bytearray(raw.get(key))
        assert len(blob) == HEADER + size
        blob[HEADER + 5] ^= 0x40
        assert raw.upsert(key, bytes(blob)) == 0
        out = run(e, name, turn(1), salt)
        assert out.cached_tokens == 0 and out.cached_tokens_details == {"device": 0, "host": 0, "storage": 0}
        assert e.tiers is not None
        c = e.tiers.hierarchy.counters
        assert c.misses == {"checksum": 1} and c.fallbacks == 1
        e.mem.verify()
        e.cache.check()
    finally:
        e.close()


def test_an_object_the_store_evicted_after_the_plan_is_a_miss(mooncake_master, salt, monkeypatch):
    """The store drops an object between ``exists`` (planning, at submit) and the read (Mooncake
    evicts its oldest keys on its own when full): the read answers NOT_FOUND, a miss counted
    ``evicted``, and the request recomputes from its device hit."""
    name = "tiny-qwen3-next"
    e = engine(name, store="mooncake", store_master=mooncake_master.address, store_memory="32MiB")
    try:
        run(e, name, A, salt)
        e.clear_cache()
        key, _ = first_key(e, A, salt)
        store = store_of(e)
        read = store._read

        def evicted_first(keys: list[str], frame_bytes: list[int]) -> list[Any]:
            if key in keys:
                assert list(store._store.batch_remove([key], True)) == [0]  # gone for real in the store
            return read(keys, frame_bytes)

        monkeypatch.setattr(store, "_read", evicted_first)
        out = run(e, name, turn(1), salt)
        assert out.cached_tokens == 0
        assert e.tiers is not None and e.tiers.hierarchy.counters.misses == {"evicted": 1}
    finally:
        e.close()


def test_a_restore_leaves_no_garbage_window_cells_behind(salt):
    """Only the window before the restored end comes back; the window cells of the pages before
    it must not be cached (a later hit ending there would read garbage): with them cached, the
    request sharing 24 tokens hits on the device and gets wrong tokens. Without them, its full
    KV comes from the device and the window before 24 from host memory."""
    name = "tiny-gemma3"
    e = engine(name, host_memory="8MiB")
    try:
        run(e, name, A, salt)
        e.clear_cache()
        assert run(e, name, turn(1), salt).cached_tokens_details["host"] == 40
        out = run(e, name, turn(2, keep=24), salt)  # exact: its window before 24 was not kept
        assert e.tiers is not None
        window = next(k for k in e.tiers.hierarchy.counters.hit_tokens if k.startswith("window:"))
        assert out.cached_tokens == 24 and out.hit is not None and out.hit.window == 0
        assert e.tiers.hierarchy.counters.hit_tokens[window]["host"] == 8 + 8  # both restores' windows
        e.mem.verify()
        e.cache.check()
    finally:
        e.close()


def test_the_only_host_read_of_memory_is_the_sampled_tokens_with_tiers(salt, monkeypatch):
    """Evictions written back and restores at admission read nothing back from the engine's memory:
    outside the frames' own headers and checksums (host buffers), the one host read per step is the
    sampled tokens, and no read at all touches the arena."""
    name = "tiny-gemma3"
    e = engine(name, host_memory="8MiB")
    arena = e.mem.arena.buffer.untyped_storage().data_ptr()
    framing_calls = []

    def paused(fn: Any) -> Any:
        def call(*args: Any) -> Any:
            every.counting = False
            framing_calls.append(fn.__name__)
            try:
                return fn(*args)
            finally:
                every.counting = True

        return call

    for module, fn in ((hierarchy, "write_header"), (base, "check"), (mooncake_store, "write_header")):
        monkeypatch.setattr(module, fn, paused(getattr(module, fn)))
    try:
        prompts = [A, turn(1), turn(2, keep=24), A]
        with (
            HostSyncCounter() as every,
            HostSyncCounter(only=lambda t: t.untyped_storage().data_ptr() == arena) as on_arena,
        ):
            for ids in prompts:
                run(e, name, ids, salt)
                e.clear_cache()
        assert e.tiers is not None and e.tiers.hierarchy.counters.restored_requests == 3
        assert "write_header" in framing_calls and "check" in framing_calls
        assert on_arena.total == 0
        assert set(every.counts) == {"tolist"} and every.counts["tolist"] <= e.stats["steps"]
    finally:
        e.close()


@pytest.fixture
def own_master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as master:
        yield master


def test_a_killed_master_marks_the_store_down_requests_go_on_and_a_restart_resumes_it(own_master, salt, monkeypatch):
    """The master dies between a request's planning (the store held its prefix) and the read: the
    read misses (``down``, counted), the request recomputes; host memory goes on serving hits,
    write-backs to the store are refused at once, nothing hangs; a restarted master brings the
    tier back."""
    name = "tiny-qwen3-next"
    e = engine(name, host_memory="8MiB", store="mooncake", store_master=own_master.address, store_memory="32MiB")
    try:
        store = store_of(e)
        store.retry_s = 0.2
        run(e, name, A, salt)
        e.clear_cache(host=True)
        read = store._read

        def killed_first(keys: list[str], frame_bytes: list[int]) -> list[Any]:
            own_master.kill()  # on the store's worker, after planning, before the read
            return read(keys, frame_bytes)

        monkeypatch.setattr(store, "_read", killed_first)
        started = time.monotonic()
        out = run(e, name, turn(1), salt)
        monkeypatch.undo()
        assert out.cached_tokens == 0 and not store.up
        assert e.tiers is not None and set(e.tiers.hierarchy.counters.misses) == {"down"}
        assert e.tiers.hierarchy.counters.fallbacks == 1
        e.clear_cache()  # host memory still works: the next turn comes back from it
        assert run(e, name, turn(2), salt).cached_tokens_details["host"] == 40
        e.clear_cache(host=True)  # written back to a store that is down: refused at once, counted
        assert run(e, name, turn(3), salt).cached_tokens == 0  # nowhere to restore from: recomputed, exact
        assert time.monotonic() - started < 10
        tiers = e.metrics()["tiers"]
        assert tiers["write_refused"]["mooncake"] > 0 and tiers["store"]["down_events"] >= 1
        own_master.start()  # same ports, no objects
        deadline = time.monotonic() + 30
        seed = 4
        while time.monotonic() < deadline:  # the tier probes while down; the client remounts its segment
            e.clear_cache(host=True)
            got = run(e, name, turn(seed), salt)
            seed += 1
            if got.cached_tokens_details["storage"]:
                break
            time.sleep(0.3)
        assert store.up and got.cached_tokens_details == {"device": 0, "host": 0, "storage": 40}
        e.mem.verify()
        e.cache.check()
    finally:
        e.close()


def test_an_object_larger_than_host_memory_goes_around_it_to_the_store(mooncake_master, salt):
    """Host memory smaller than one state checkpoint (a real model's is tens of MiB per rank): the checkpoint goes
    straight to the store (counted), the pages to host memory, and the next turn hits both, exact."""
    name = "tiny-qwen3-next"
    sizes = {str(pool): HEADER + n for pool, n in hierarchy_sizes(name).items()}
    budget = sizes["state"] - 1  # every page object fits (host memory evicts the older ones on), no checkpoint does
    assert budget > sizes["full"]
    e = engine(name, host_memory=budget, store="mooncake", store_master=mooncake_master.address, store_memory="32MiB")
    try:
        run(e, name, A, salt)
        checkpoints = e.cache.stats()["states"]  # the state checkpoints the device cache holds
        e.clear_cache()  # device -> host memory, and the checkpoints around it to the store
        tiers = e.metrics()["tiers"]
        assert tiers["write_around"] == {"state": checkpoints} and "host" not in tiers["write_refused"]
        back = run(e, name, turn(1), salt)
        assert back.cached_tokens == 40  # without the checkpoint in the store: no hit (the state is part of it)
        assert back.cached_tokens_details["device"] == 0
    finally:
        e.close()
    alone = engine(name, host_memory=budget)  # no store below: refused and counted, never silent
    try:
        run(alone, name, A, salt)
        assert alone.cache.stats()["states"] == checkpoints
        alone.clear_cache()
        tiers = alone.metrics()["tiers"]
        assert tiers["write_refused"] == {"host": checkpoints} and not tiers["write_around"]
    finally:
        alone.close()


def hierarchy_sizes(name: str) -> dict[Any, int]:
    e = engine(name, host_memory="8MiB")
    try:
        assert e.tiers is not None
        return dict(e.tiers.hierarchy.keys.payload_bytes)
    finally:
        e.close()
