"""The vLLM connector worker's tiers (no vLLM needed): the report keeps the scheduler's index truthful, and
blocks read from the store are promoted into the host tier."""

from __future__ import annotations

import torch

from hybridkv.integrations.vllm.layout import BlockIndex, GroupKind, GroupLayout, block_key, split_key
from hybridkv.integrations.vllm.worker_tiers import Pair, WorkerTiers
from hybridkv.tiers import DictStore, MissReason
from hybridkv.tiers.framing import HEADER, frame

PAYLOAD = 64
FRAME = HEADER + PAYLOAD
PREFIXES = ["m/g0/", "m/g1/"]
GROUPS = [GroupLayout(g, GroupKind.FULL, 4, None, (f"l{g}",), "s") for g in range(2)]


def pair_of(key: str) -> Pair | None:
    prefix, name = split_key(key)
    return (PREFIXES.index(prefix), name) if prefix in PREFIXES else None


def key(pair: Pair) -> str:
    return block_key(PREFIXES[pair[0]], pair[1])


def payload(pair: Pair) -> torch.Tensor:
    return torch.full((PAYLOAD,), 7 * pair[0] + pair[1], dtype=torch.uint8)


def put(tiers: WorkerTiers, pairs: list[Pair]) -> int:
    keys = [key(p) for p in pairs]
    return tiers.put(pairs, keys, [frame(k, payload(p)) for k, p in zip(keys, pairs, strict=True)], "g")


def report_to(index: BlockIndex, tiers: WorkerTiers) -> None:
    """What the scheduler does with the worker's report (``update_connector_output``)."""
    stored, dropped = tiers.take_report()
    assert not set(stored) & set(dropped)  # one verdict per pair
    index.discard(dropped)
    index.add(stored)


def host_pairs(tiers: WorkerTiers, pairs: list[Pair]) -> set[Pair]:
    held = tiers.host.exists([key(p) for p in pairs])
    return {p for p, h in zip(pairs, held, strict=True) if h}


def test_a_block_stored_and_evicted_in_one_batch_is_not_held() -> None:
    """One save batch larger than the host budget, no store: the blocks it evicted again are reported dropped."""
    tiers, index = WorkerTiers(2 * FRAME, None, pair_of), BlockIndex(GROUPS)
    batch = [(0, n) for n in range(1, 6)]
    assert put(tiers, batch) == 5
    report_to(index, tiers)
    assert host_pairs(tiers, batch) == {(0, 4), (0, 5)}  # the last two fit
    assert index.held == {(0, 4), (0, 5)}
    # two batches of one step (one per group): the second evicts the first's
    put(tiers, [(0, 6)])
    put(tiers, [(1, 6), (1, 7)])
    report_to(index, tiers)
    assert index.held == host_pairs(tiers, [*batch, (0, 6), (1, 6), (1, 7)]) == {(1, 6), (1, 7)}
    # evicted, then stored again in the same step: held
    put(tiers, [(0, 6)])
    put(tiers, [(1, 8)])
    report_to(index, tiers)
    assert index.held == {(0, 6), (1, 8)} == host_pairs(tiers, [(0, 6), (1, 6), (1, 7), (1, 8)])


def test_a_failed_load_then_a_save_of_the_same_block_is_held() -> None:
    tiers, index = WorkerTiers(4 * FRAME, None, pair_of), BlockIndex(GROUPS)
    put(tiers, [(0, 1)])
    report_to(index, tiers)
    tiers.evict([key((0, 1))])
    tiers.drop([(0, 1)])  # its load failed: removed
    put(tiers, [(0, 1)])  # the recompute saves it again in the same step
    report_to(index, tiers)
    assert index.held == {(0, 1)}


def test_blocks_read_from_the_store_are_promoted_into_the_host_tier() -> None:
    store = DictStore()
    tiers, index = WorkerTiers(2 * FRAME, store, pair_of), BlockIndex(GROUPS)
    blocks = [(0, n) for n in range(1, 5)]
    put(tiers, blocks)  # 1 and 2 are written back to the store
    report_to(index, tiers)
    assert index.held == set(blocks) and host_pairs(tiers, blocks) == {(0, 3), (0, 4)}
    assert tiers.stats["written_back"] == 2 and len(store) == 2
    got = tiers.get([key((0, 1)), key((0, 3))], PAYLOAD, "g")
    assert not any(isinstance(p, MissReason) for p in got)
    assert [int(p[0]) for p in got if not isinstance(p, MissReason)] == [1, 3]
    assert tiers.stats["store_loaded_blocks"] == 1
    tiers.promote()
    # block 1 is back in the host tier, most recently used; the host's least recently used block (4:
    # the get touched 3) went down to the store; the budget holds
    assert host_pairs(tiers, blocks) == {(0, 1), (0, 3)}
    assert tiers.host.used_bytes <= tiers.host.budget
    assert tiers.stats["promoted"] == 1 and store.exists([key((0, 4))]).all()
    report_to(index, tiers)
    assert index.held == set(blocks)  # nothing left: the index is unchanged and truthful
    tiers.promote()  # promotions are taken once
    assert tiers.stats["promoted"] == 1
    # a second read of block 1 comes from the host tier
    before = store.stats.gets
    tiers.get([key((0, 1))], PAYLOAD, "g")
    assert store.stats.gets == before and tiers.stats["store_loaded_blocks"] == 1


def test_a_promotion_the_store_cannot_take_back_reports_the_block_it_evicts() -> None:
    """The host evicts to make room for a promoted block and the store refuses it: that block is dropped."""
    store = DictStore(capacity=FRAME)  # room for one object: the second write-back evicts the first silently
    tiers, index = WorkerTiers(FRAME, store, pair_of), BlockIndex(GROUPS)
    put(tiers, [(0, 1), (0, 2)])  # 1 written back
    report_to(index, tiers)
    assert index.held == {(0, 1), (0, 2)}
    tiers.get([key((0, 1))], PAYLOAD, "g")
    tiers.promote()  # 2 is evicted to the store (which silently drops 1: its own eviction)
    report_to(index, tiers)
    assert host_pairs(tiers, [(0, 1), (0, 2)]) == {(0, 1)} and index.held == {(0, 1), (0, 2)}
    big = WorkerTiers(FRAME, DictStore(capacity=0), pair_of)
    put(big, [(0, 1), (0, 2)])  # the store refuses every write-back: 1 is dropped
    index2 = BlockIndex(GROUPS)
    report_to(index2, big)
    assert index2.held == {(0, 2)}
