"""Every backend (dict, host memory, the real Mooncake Store) stores and returns framed objects
byte-exact, batched; a missing, resized, corrupted or mis-keyed object is a miss with its
reason, never bytes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from hybridkv.tiers import DictStore, HostTier, MissReason, MooncakeStoreTier, PutStatus, StorageTier, TierError
from hybridkv.tiers.framing import HEADER, frame

BACKENDS = ("dict", "host", "mooncake")


def _payloads(n: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for _ in range(n)]


@pytest.fixture(params=BACKENDS)
def tier(request: pytest.FixtureRequest) -> Iterator[StorageTier]:
    if request.param == "dict":
        yield DictStore()
    elif request.param == "host":
        yield HostTier(1 << 20)
    else:
        yield request.getfixturevalue("mooncake_store")


def _corrupt(tier: StorageTier, key: str, size: int, at: int) -> None:
    """Flip one byte of the stored object through the store's own API."""
    if isinstance(tier, MooncakeStoreTier):
        raw = tier._store  # the Mooncake client itself: read the object, flip, upsert
        blob = bytearray(raw.get(key))
        blob[at] ^= 0x40
        assert raw.upsert(key, bytes(blob)) == 0
        return
    blob = tier._read([key], [HEADER + size])[0]  # the backend's own frame, then put back changed
    assert isinstance(blob, torch.Tensor)
    bad = blob.clone()
    bad[at] ^= 0x40
    tier.evict([key])
    assert tier.put([key], [bad]) == [PutStatus.STORED]


def test_round_trip_batched(tier, unique):
    keys = [f"{unique}{i}" for i in range(6)]
    payloads = _payloads(6, 4096)
    assert tier.put(keys, [frame(k, p) for k, p in zip(keys, payloads, strict=True)], "full") == [PutStatus.STORED] * 6
    got = tier.get([*keys, f"{unique}missing"], [4096] * 7)
    for g, p in zip(got[:6], payloads, strict=True):
        assert isinstance(g, torch.Tensor) and torch.equal(g, p)
    assert got[6] is MissReason.ABSENT
    assert tier.exists([keys[0], f"{unique}missing", keys[5]]).tolist() == [True, False, True]
    assert tier.evict(keys[:2]) == 2
    assert tier.exists(keys[:3]).tolist() == [False, False, True]
    assert tier.get(keys[:1], [4096]) == [MissReason.ABSENT]
    assert tier.stats.gets == 6 and tier.stats.misses["absent"] == 2


def test_asynchronous_tickets(tier, unique):
    keys = [f"{unique}{i}" for i in range(3)]
    ticket = tier.submit_put(keys, [frame(k, p) for k, p in zip(keys, _payloads(3, 100), strict=True)])
    assert ticket.wait(10) == [PutStatus.STORED] * 3 and ticket.poll()
    got = tier.submit_get(keys, [100] * 3)
    assert all(isinstance(g, torch.Tensor) for g in got.wait(10))


def test_first_copy_of_a_key_is_kept(tier, unique):
    key = f"{unique}k"
    a, b = _payloads(2, 256)
    tier.put([key], [frame(key, a)])
    tier.put([key], [frame(key, b)])
    got = tier.get([key], [256])[0]
    assert isinstance(got, torch.Tensor) and torch.equal(got, a)


def test_wrong_size_is_a_miss(tier, unique):
    key = f"{unique}k"
    tier.put([key], [frame(key, _payloads(1, 512)[0])])
    assert tier.get([key], [511]) == [MissReason.SIZE]
    assert tier.get([key], [600]) == [MissReason.SIZE]


@pytest.mark.parametrize(("at", "reason"), [(HEADER + 100, MissReason.CHECKSUM), (10, MissReason.HEADER)])
def test_corrupted_byte_is_a_miss(tier, unique, at, reason):
    key = f"{unique}k"
    tier.put([key], [frame(key, _payloads(1, 512)[0])])
    _corrupt(tier, key, 512, at)
    assert tier.get([key], [512]) == [reason]
    assert tier.stats.misses[reason.value] == 1


def test_object_under_another_key_is_a_miss(tier, unique):
    k1, k2 = f"{unique}1", f"{unique}2"
    tier.put([k2], [frame(k1, _payloads(1, 64)[0])])  # k1's frame stored under k2
    assert tier.get([k2], [64]) == [MissReason.HEADER]


def test_bad_arguments_are_refused(tier):
    with pytest.raises(TierError, match="keys"):
        tier.put([""], [frame("x", _payloads(1, 4)[0])])
    with pytest.raises(TierError, match="frames"):
        tier.put(["x", "y"], [frame("x", _payloads(1, 4)[0])])
    with pytest.raises(TierError, match="uint8"):
        tier.put(["x"], [torch.zeros(4, dtype=torch.float32)])


# --- host memory -----------------------------------------------------------------------------


def test_host_evicts_least_recently_used_within_its_budget():
    size = HEADER + 1000
    host = HostTier(3 * size)
    keys = ["a", "b", "c", "d"]
    host.put(keys[:3], [frame(k, p) for k, p in zip(keys[:3], _payloads(3, 1000), strict=True)], "full")
    host.get(["a"], [1000])  # a is now the most recent
    host.put(["d"], [frame("d", _payloads(1, 1000)[0])], "state")
    assert host.exists(keys).tolist() == [True, False, True, True]
    assert host.used_bytes == 3 * size <= host.budget and host.evictions == 1
    assert host.bytes_by_label == {"full": 2 * size, "state": size}


def test_host_split_between_components_follows_the_bytes():
    """No fixed ratio: a budget filled with state only holds state; then KV displaces it."""
    host = HostTier(10 * (HEADER + 100))
    host.put([f"s{i}" for i in range(10)], [frame(f"s{i}", p) for i, p in enumerate(_payloads(10, 100))], "state")
    assert host.bytes_by_label["state"] == host.budget
    host.put([f"k{i}" for i in range(7)], [frame(f"k{i}", p) for i, p in enumerate(_payloads(7, 100))], "full")
    assert host.bytes_by_label == {"state": 3 * (HEADER + 100), "full": 7 * (HEADER + 100)}


def test_host_hands_evictions_to_its_sink():
    size = HEADER + 100
    got: list[tuple[list[str], list[str], list[torch.Tensor]]] = []
    host = HostTier(2 * size, on_evict=lambda keys, frames, labels: got.append((keys, labels, frames)))
    frames = [frame(k, p) for k, p in zip("abc", _payloads(3, 100), strict=True)]
    host.put(["a", "b", "c"], frames, "full")
    assert [(k, lab) for k, lab, _ in got] == [(["a"], ["full"])]
    assert got[0][2][0] is frames[0]  # the frame itself: the sink owns it now


def test_host_refuses_only_what_exceeds_its_budget():
    host = HostTier(HEADER + 10)
    assert host.put(["big"], [frame("big", _payloads(1, 11)[0])]) == [PutStatus.REFUSED]
    assert host.put(["ok"], [frame("ok", _payloads(1, 10)[0])]) == [PutStatus.STORED]


def test_host_pinning_says_why():
    host = HostTier("1MiB")
    assert host.pinned == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert "no CUDA device" in host.pin_note
        with pytest.raises(TierError, match="CUDA"):
            HostTier(1000, pin=True)
    with pytest.raises(TierError, match="budget"):
        HostTier(0)


# --- stores that evict on their own ----------------------------------------------------------


def test_dict_store_evicts_oldest_silently():
    size = HEADER + 100
    store = DictStore(capacity=3 * size)
    keys = [f"k{i}" for i in range(5)]
    assert (
        store.put(keys, [frame(k, p) for k, p in zip(keys, _payloads(5, 100), strict=True)]) == [PutStatus.STORED] * 5
    )
    assert store.exists(keys).tolist() == [False, False, True, True, True]
    assert store.silent_evictions == 2 and store.used_bytes == 3 * size


def test_mooncake_full_store_refuses_and_evicts_oldest(mooncake_master, unique):
    """A 16 MiB segment (the least the client takes), 4 MiB objects: puts past the capacity
    answer NO_AVAILABLE_HANDLE (REFUSED) and the store evicts old keys on its own; those
    read back as misses."""
    store = MooncakeStoreTier(mooncake_master.address, segment_bytes=16 << 20)
    try:
        keys = [f"{unique}{i}" for i in range(12)]
        size = (4 << 20) - HEADER
        statuses = []
        for key, p in zip(keys, _payloads(12, size), strict=True):
            statuses += store.put([key], [frame(key, p)])
        assert PutStatus.STORED in statuses and PutStatus.REFUSED in statuses
        time.sleep(0.5)  # the master evicts in the background
        held = store.exists(keys)
        assert not held.all() and not held[0]  # the oldest went
        got = store.get(keys, [size] * len(keys))
        assert all((g is MissReason.ABSENT) != h for g, h in zip(got, held, strict=True))
    finally:
        store.close()
