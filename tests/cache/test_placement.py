"""Checkpoint placement: specs parse or are refused with a message naming what to change, and
each placement asks the manager for exactly its positions (through ``KVManager``)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import CacheError, CheckpointPlacement, HybridRadixCache, KVManager, PlacementError
from hybridkv.cache.placement import DEFAULT, engine_default
from tests.cache.helpers import small_memory

PS = 4


@pytest.mark.parametrize(
    ("spec", "normalised"),
    [
        ("none", "none"),
        (" none ", "none"),
        ("interval:8", "interval:8"),
        ("prompt-aligned", "prompt-aligned"),
        ("prompt-aligned:12", "prompt-aligned:12"),
        ("branch", "branch"),
        ("end", "end"),
        ("interval:16, branch ,end", "interval:16,branch,end"),
        (DEFAULT, DEFAULT),
    ],
)
def test_specs_parse(spec: str, normalised: str) -> None:
    assert CheckpointPlacement.parse(spec, PS).spec == normalised


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "unknown checkpoint placement ''"),
        ("fixed:8", "unknown checkpoint placement 'fixed:8'.*interval:N, prompt-aligned"),
        ("none,branch", "unknown checkpoint placement 'none'"),
        ("interval", "needs a token count: interval:N"),
        ("interval:", "unknown checkpoint placement 'interval:'"),
        ("interval:six", "'six' is not a token count"),
        ("interval:6", "positive multiple of the page size 4"),
        ("interval:0", "positive multiple of the page size 4"),
        ("interval:-8", "positive multiple of the page size 4"),
        ("prompt-aligned:10", "positive multiple of the page size 4"),
        ("branch:4", "'branch' takes no argument"),
        ("end:8", "'end' takes no argument"),
        ("branch,branch", "'branch' is given twice"),
        ("interval:8,interval:8", "given twice"),
    ],
)
def test_bad_specs_are_refused(spec: str, message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        CheckpointPlacement.parse(spec, PS)


def test_the_manager_refuses_a_placement_for_another_page_size() -> None:
    cache = HybridRadixCache(small_memory("tiny-gdn", PS, budget=400_000))
    with pytest.raises(CacheError, match="for page size 4"):
        KVManager(cache, CheckpointPlacement.parse("branch", 8))
    with pytest.raises(PlacementError, match="multiple of the page size 4"):
        KVManager(cache, "interval:6")


def _cached(kvm: KVManager, tokens: np.ndarray) -> None:
    """Cache ``tokens`` (page-aligned) with a checkpoint at their end, as a finished request would."""
    kv = kvm.admit(kvm.match(tokens[:0]))
    kvm.extend(kv, tokens.size)
    kvm.checkpoints.reserve(kv, tokens.size)
    kvm.finish(kv, tokens)


SHARED = np.arange(100, 122)  # 22 tokens: the tree holds 20 of them (5 pages)
PROMPT = np.concatenate([SHARED, np.arange(500, 509)])  # 31 tokens, branching from SHARED at 22 (page 20)


def _wanted(spec: str, prompt: np.ndarray = PROMPT) -> tuple[tuple[int, ...], int | None, int]:
    """(prefill positions, finish position, hit) of a request of ``prompt`` after one that
    cached ``SHARED[:20] + [0] * 8`` (so the prompt leaves the cached path at 20, no checkpoint there)."""
    cache = HybridRadixCache(small_memory("tiny-gdn", PS, budget=400_000))
    kvm = KVManager(cache, spec)
    _cached(kvm, np.concatenate([SHARED[:20], np.zeros(8, dtype=np.int64)]))
    match = kvm.match(prompt[:-1])
    kv = kvm.admit(match)
    assert (match.length, match.full_length, match.checkpoint_at) == (0, 20, 20)
    wanted = kvm.checkpoints.wanted(kv, prompt.size)
    kvm.extend(kv, prompt.size + 6)  # prefill and decode 6 tokens: 37
    at_finish = kvm.checkpoints.at_finish(kv)
    kvm.release(kv)
    cache.check()
    return wanted, at_finish, match.length


@pytest.mark.parametrize(
    ("spec", "prefill", "finish"),
    [
        ("none", (), None),
        ("interval:8", (8, 16, 24), None),  # every 8 tokens inside the 31-token prompt
        ("interval:12", (12, 24), None),
        ("prompt-aligned", (28,), None),  # 31 rounded down to the page
        ("prompt-aligned:16", (16,), None),
        ("branch", (20,), None),  # where the prompt leaves the cached full KV
        ("end", (), 36),  # 37 tokens at finish, rounded down to the page
        (DEFAULT, (20, 28), 36),
        ("interval:8,branch", (8, 16, 20, 24), None),
        ("interval:8,prompt-aligned:8", (8, 16, 24), None),  # the same position once
    ],
)
def test_each_placement_asks_for_its_positions(spec: str, prefill: tuple[int, ...], finish: int | None) -> None:
    assert _wanted(spec) == (prefill, finish, 0)


@pytest.mark.parametrize(
    ("spec", "shared", "at"),
    [
        *[("branch", 23, 20), ("branch", 20, 20), ("branch", 3, None), ("interval:8,branch", 9, 8)],
        *[(DEFAULT, 31, 28), ("interval:8", 23, None), ("prompt-aligned,end", 23, None), ("none", 23, None)],
    ],
)
def test_a_prompt_branches_off_another_in_prefill_at_a_page_only_under_branch(
    spec: str, shared: int, at: int | None
) -> None:
    assert CheckpointPlacement.parse(spec, PS).branch_off(shared) == at


def test_positions_start_past_the_hit() -> None:
    """A request whose hit ends at 20 (the checkpoint its predecessor stored at the branch)
    is asked only for positions past 20; the branch is no longer one (its match is whole)."""
    cache = HybridRadixCache(small_memory("tiny-gdn", PS, budget=400_000))
    kvm = KVManager(cache, "interval:8,branch,prompt-aligned")
    _cached(kvm, SHARED[:20])
    kv = kvm.admit(kvm.match(PROMPT[:-1]))
    assert kv.seq_len == 20 and kv.match.checkpoint_at is None
    assert kvm.checkpoints.wanted(kv, PROMPT.size) == (24, 28)
    kvm.release(kv)


def test_a_model_without_state_wants_no_checkpoints() -> None:
    cache = HybridRadixCache(small_memory("tiny-swa", PS))
    kvm = KVManager(cache, "interval:8,branch,end")
    kv = kvm.admit(kvm.match(PROMPT[:-1]))
    kvm.extend(kv, PROMPT.size)
    assert kvm.checkpoints.wanted(kv, PROMPT.size) == () and kvm.checkpoints.at_finish(kv) is None
    kvm.release(kv)


def test_the_branch_checkpoint_makes_the_next_hit() -> None:
    """The request that branches stores its state at the branch; the next one sharing the
    prefix hits exactly there, on the state component too."""
    cache = HybridRadixCache(small_memory("tiny-gdn", PS, budget=400_000))
    kvm = KVManager(cache, "branch")
    _cached(kvm, np.concatenate([SHARED[:20], np.zeros(8, dtype=np.int64)]))
    kv = kvm.admit(kvm.match(PROMPT[:-1]))
    for at in kvm.checkpoints.wanted(kv, PROMPT.size):
        kvm.checkpoints.reserve(kv, at)
    kvm.extend(kv, PROMPT.size)
    kvm.finish(kv, PROMPT)
    third = np.concatenate([SHARED, np.arange(900, 910)])
    match = kvm.match(third)
    assert (match.length, match.checkpoint_length, match.checkpoint_at) == (20, 20, None)
    cache.check()
    cache.mem.verify()


def test_engine_default_adds_whole_page_chunk_ends_and_parses() -> None:
    assert engine_default(64, 16) == "interval:64,prompt-aligned,branch,end"
    assert engine_default(70, 16) == "interval:64,prompt-aligned,branch,end"  # rounded down to whole pages
    assert engine_default(8, 16) == DEFAULT  # a chunk shorter than a page: no interval
    assert CheckpointPlacement.parse(engine_default(70, 16), 16).prefill(None, 200, 0)[:3] == (64, 128, 192)
