"""Misuse refused before anything changes (issue 9, items 7-9): counts of other types,
negative and out-of-range ids, two requests continuing the same partial page.

Each case asserts the error (naming the argument, the ids or the requests), that every
table and byte is as before (``snapshot``), and that ``verify()`` passes.
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hybridkv.memory import InvalidIds, OutOfMemory, TokenAllocator, UnifiedMemory
from hybridkv.spec import FULL_POOL, RECURRENT_POOL, PoolId, ShardSpec, WindowPool, get_preset
from tests.memory.snapshots import assert_unchanged, snapshot

PS = 4
POOLS: list[PoolId] = [FULL_POOL, WindowPool(8), WindowPool(24), RECURRENT_POOL]


def _memory() -> UnifiedMemory:
    mem = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-swa2-state")), 300_000, page_size=PS, max_context=64, chunk_tokens=16
    )
    mem.arena.buffer.copy_(torch.randint(0, 255, (mem.arena.nbytes,), dtype=torch.uint8))
    return mem


@pytest.fixture
def mem() -> UnifiedMemory:
    return _memory()


def assert_refused(mem: UnifiedMemory, match: str, call, *args) -> InvalidIds:
    before = snapshot(mem)
    with pytest.raises(InvalidIds, match=match) as refused:
        call(*args)
    assert_unchanged(before, mem)
    mem.verify()
    return refused.value


# --- item 7: counts --------------------------------------------------------------------------


def test_a_float_count_is_refused_before_any_slab_is_taken(mem):
    assert_refused(mem, r"alloc_pages: count must be an int >= 0, got float 2\.0", mem.alloc_pages, 2.0)
    assert_refused(mem, r"alloc_state: count must be an int >= 0, got float 1\.0", mem.alloc_state, 1.0)
    assert_refused(mem, r"alloc: num_tokens must be an int >= 0, got float 10\.0", TokenAllocator(mem).alloc, 10.0)
    assert_refused(mem, "got bool True", mem.alloc_pages, True)
    assert_refused(mem, "got float64", mem.alloc_pages, np.float64(3))
    assert_refused(mem, r"alloc_pages: count must be >= 0, got -1", mem.alloc_pages, -1)


def test_numpy_integer_counts_are_accepted(mem):
    assert mem.alloc_pages(np.int64(2)).size == 2
    assert mem.alloc_state(np.int32(1)).size == 1
    assert TokenAllocator(mem).alloc(np.uint8(5)).size == 5
    row = TokenAllocator(mem).alloc(9)
    TokenAllocator(mem).free_segment(row[PS:], np.int64(PS))
    mem.windows.free_outside_span(np.unique(row[:PS] // PS), np.int16(PS))
    assert mem.compact(np.int64(1)) in (0, 1)  # at most the one slab asked for
    mem.verify()


BAD_COUNTS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.integers(max_value=-1),
    st.text(max_size=3),
    st.none(),
    st.just(Fraction(3, 1)),
    st.just(Decimal(2)),
    st.just(np.float32(1)),
    st.just(np.bool_(True)),
    st.lists(st.integers(0, 3), max_size=2),
    st.just(torch.tensor(2)),
    st.just(np.array([2])),
)


@settings(max_examples=150, deadline=None)
@given(
    count=BAD_COUNTS, call=st.sampled_from(["alloc_pages", "alloc_state", "alloc", "free_segment", "span", "compact"])
)
def test_counts_of_other_types_are_refused_and_change_nothing(count, call):
    assume(not (call == "compact" and count is None))  # compact(None): no limit
    mem = _memory()
    row = TokenAllocator(mem).alloc(9)
    targets = {
        "alloc_pages": (mem.alloc_pages, "alloc_pages: count"),
        "alloc_state": (mem.alloc_state, "alloc_state: count"),
        "alloc": (TokenAllocator(mem).alloc, "alloc: num_tokens"),
        "free_segment": (lambda n: TokenAllocator(mem).free_segment(row[PS:], n), "free_segment: start_pos"),
        "span": (lambda n: mem.windows.free_outside_span(row[::PS] // PS, n), "free_outside_span: seq_len"),
        "compact": (mem.compact, "compact: max_slabs"),
    }
    fn, name = targets[call]
    assert_refused(mem, f"^{name} must be", fn, count)


# --- item 8: ids outside the tables ----------------------------------------------------------


def test_negative_ids_do_not_read_a_live_requests_entries(mem):
    row = TokenAllocator(mem).alloc(6)  # a live request: its pages are the highest-numbered ones in use
    pages = row[::PS] // PS
    slots = mem.alloc_state(1)
    cap = mem.pages.capacity
    assert_refused(mem, r"translate: token locations \[-1\] outside the valid range 0\.\.", mem.translate, [-1])
    assert_refused(mem, "token locations", mem.translate, torch.tensor([row[0], -3]))
    assert_refused(mem, r"page_cells in full: page ids \[-2\]", mem.page_cells, np.array([-2]), FULL_POOL)
    assert_refused(mem, r"page ids \[-1\]", mem.page_cells, torch.tensor([-1]), WindowPool(8))
    assert_refused(mem, r"host_cells in swa:24: page ids \[-1\]", mem.host_cells, [-1], WindowPool(24))
    assert_refused(mem, r"resident in full: page ids \[-5\]", mem.resident, [-5], FULL_POOL)
    assert_refused(mem, r"slot ids \[-1\]", mem.page_cells, [-1], RECURRENT_POOL)
    assert_refused(mem, rf"valid range 0\.\.{cap - 1}", mem.host_cells, [pages[0], cap], FULL_POOL)
    too_far = rf"token locations \[{cap * PS}\] outside the valid range 0\.\.{cap * PS - 1}"
    assert_refused(mem, too_far, mem.translate, [cap * PS])
    assert_refused(mem, "slot ids", mem.host_cells, [slots[0], 10**9], RECURRENT_POOL)
    # in range still works, the sink and tombstones included
    assert mem.translate(row).shape == (6,)
    assert mem.host_cells([0, pages[0]], FULL_POOL)[0] == 0


IDS_AS = ["list", "numpy", "tensor"]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), call=st.sampled_from(["translate", "page_cells", "host_cells", "resident"]))
def test_out_of_range_ids_are_refused_naming_them_and_the_range(data, call):
    mem = _memory()
    row = TokenAllocator(mem).alloc(data.draw(st.integers(1, 20)))
    mem.alloc_state(1)
    pool = data.draw(st.sampled_from(POOLS if call != "translate" else [FULL_POOL, WindowPool(8), WindowPool(24)]))
    limit = len(mem.pools[pool].v2p) * (PS if call == "translate" else 1)
    valid = row if call == "translate" else np.unique(row // PS)
    if pool == RECURRENT_POOL:
        valid = np.flatnonzero(mem.slots.live)
    bad = data.draw(st.lists(st.one_of(st.integers(-(2**62), -1), st.integers(limit, 2**62)), min_size=1, max_size=3))
    good = data.draw(st.lists(st.sampled_from(valid.tolist()), max_size=4))
    ids = data.draw(st.permutations(good + bad))
    form = data.draw(st.sampled_from(IDS_AS if call in ("translate", "page_cells") else IDS_AS[:2]))
    arg = {"list": ids, "numpy": np.array(ids, dtype=np.int64), "tensor": torch.tensor(ids, dtype=torch.int64)}[form]
    fn = getattr(mem, call)
    error = assert_refused(mem, rf"outside the valid range 0\.\.{limit - 1}", fn, arg, pool)
    assert all(str(b) in str(error) for b in bad), f"{error} does not name every bad id of {bad}"


ID_CALLS = {
    "free_pages": lambda mem, ids: mem.free_pages(ids),
    "free": lambda mem, ids: TokenAllocator(mem).free(ids),
    "free_segment": lambda mem, ids: TokenAllocator(mem).free_segment(ids, 0),
    "free_window_pages": lambda mem, ids: mem.windows.free(ids),
    "free_window_pages swa:8": lambda mem, ids: mem.windows.free(ids, WindowPool(8)),
    "free_outside_span": lambda mem, ids: mem.windows.free_outside_span(ids, 0),
    "adopt_window_pages": lambda mem, ids: mem.windows.adopt(ids, ids, WindowPool(24)),
    "pin": lambda mem, ids: mem.pin(pages=ids),
    "pin slots": lambda mem, ids: mem.pin(slots=ids),
    "free_state": lambda mem, ids: mem.free_state(ids),
    "fork_state": lambda mem, ids: mem.fork_state(ids),
    "alloc_decode": lambda mem, ids: TokenAllocator(mem).alloc_decode(np.full(len(ids), 7), ids),
    "alloc_extend": lambda mem, ids: TokenAllocator(mem).alloc_extend(np.full(len(ids), 6), np.full(len(ids), 9), ids),
}


@settings(max_examples=150, deadline=None)
@given(data=st.data(), call=st.sampled_from(sorted(ID_CALLS)))
def test_every_call_taking_ids_refuses_negative_and_out_of_range_ones(data, call):
    mem = _memory()
    row = TokenAllocator(mem).alloc(6)
    mem.alloc_state(1)
    limit = max(mem.pages.capacity, mem.slots.capacity) * PS
    bad = data.draw(st.lists(st.one_of(st.integers(-(2**62), -1), st.integers(limit, 2**62)), min_size=1, max_size=2))
    ids = np.array(data.draw(st.permutations([int(row[-1] // PS), *bad])), dtype=np.int64)
    before = snapshot(mem)
    with pytest.raises(InvalidIds):
        ID_CALLS[call](mem, ids)
    assert_unchanged(before, mem)
    mem.verify()


# --- item 9: two requests continuing one partial page ----------------------------------------


def test_two_requests_continuing_the_same_last_page_are_refused(mem):
    row = TokenAllocator(mem).alloc(6)  # 6 tokens of 4 a page: the last page holds 2
    last = row[-1]
    assert_refused(mem, "requests 0 and 1 both continue page", TokenAllocator(mem).alloc_decode, [7, 7], [last, last])
    assert_refused(
        mem, "requests 0 and 2 both continue", TokenAllocator(mem).alloc_extend, [6, 0, 6], [9, 4, 8], [last, 0, last]
    )
    # a second "request" claiming a longer row on the same page: its last token is the
    # slot the first one's next token would get
    assert_refused(
        mem, "requests 0 and 1 both continue page", TokenAllocator(mem).alloc_decode, [8, 7], [last + 1, last]
    )
    # continuing the page once is fine; a request that fills it exactly does not continue it
    assert TokenAllocator(mem).alloc_decode([7], [last]).tolist() == [last + 1]
    # one row writes into the page another (claiming it full) ends on: its token would go
    assert_refused(
        mem, "requests 0 and 1 both continue page", TokenAllocator(mem).alloc_decode, [8, 9], [last + 1, last + 2]
    )
    # two rows ending on the same full page (a shared prefix) both start fresh pages: fine
    full = TokenAllocator(mem).alloc(8)
    out = TokenAllocator(mem).alloc_decode([9, 9], [full[-1], full[-1]])
    assert out[0] != out[1]
    more = TokenAllocator(mem).alloc_extend([8, 8], [10, 13], [full[-1], full[-1]])
    assert np.unique(more).size == more.size == 7
    mem.verify()


@settings(max_examples=120, deadline=None)
@given(data=st.data(), lengths=st.lists(st.integers(1, 15), min_size=1, max_size=5), decode=st.booleans())
def test_a_shared_last_page_in_any_batch_is_refused(data, lengths, decode):
    mem = _memory()
    rows = [TokenAllocator(mem).alloc(n) for n in lengths]
    partial = [i for i, r in enumerate(rows) if r.size % PS]
    if not partial:
        rows.append(TokenAllocator(mem).alloc(PS + 1))
        partial = [len(rows) - 1]
    shared = data.draw(st.sampled_from(partial))
    batch = data.draw(st.permutations([*range(len(rows)), shared]))
    seq = np.array([rows[i].size for i in batch], dtype=np.int64)
    last = np.array([rows[i][-1] for i in batch], dtype=np.int64)
    if decode:
        assert_refused(mem, "both continue page", TokenAllocator(mem).alloc_decode, seq + 1, last)
    else:
        grow = np.array(data.draw(st.lists(st.integers(1, 9), min_size=seq.size, max_size=seq.size)))
        assert_refused(mem, "both continue page", TokenAllocator(mem).alloc_extend, seq, seq + grow, last)
    # the same rows, each once, go through on slots of their own
    seq = np.array([r.size for r in rows], dtype=np.int64)
    out = TokenAllocator(mem).alloc_decode(seq + 1, np.array([r[-1] for r in rows], dtype=np.int64))
    assert np.unique(out).size == out.size
    mem.verify()


# --- issue 19, item 10: a refusal moves no hint ------------------------------------------------


@pytest.mark.parametrize("count", [250, 60, 200])
def test_a_refused_allocation_leaves_every_hint_as_it_was(mem, count):
    """A refusal for want of slabs takes free slabs tentatively and hands them back: the
    pools' slab hints (``last_slab``: where the next slab is sought) stay where they were, so
    later allocations stay beside the pools' slabs instead of scattering from the far end."""
    held = mem.alloc_pages(3)
    state = mem.alloc_state(2)
    before = snapshot(mem)
    hints = {str(p.pool_id): p.last_slab for p in mem.pools.values()}
    with pytest.raises(OutOfMemory, match="short of cells"):
        mem.alloc_pages(count)
    assert {str(p.pool_id): p.last_slab for p in mem.pools.values()} == hints
    assert_unchanged(before, mem)
    twin = _memory()  # the same calls without the refusal: everything after it is the same too
    twin.alloc_pages(3)
    twin.alloc_state(2)
    more = mem.alloc_pages(40)
    assert np.array_equal(more, twin.alloc_pages(40))
    mine, theirs = snapshot(mem), snapshot(twin)
    assert not [k for k in mine if k != "bytes" and not np.array_equal(mine[k], theirs[k])]
    mem.free_pages(np.concatenate([held, more]))
    mem.free_state(state)
    mem.verify()


def test_a_refused_state_allocation_leaves_every_hint_as_it_was(mem):
    mem.alloc_pages(3)
    before = snapshot(mem)
    with pytest.raises(OutOfMemory):
        mem.alloc_state(mem.slots.free_count)
    assert_unchanged(before, mem)
