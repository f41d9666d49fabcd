"""Bad input: a clear error, and the pools exactly as they were (tables, counters, bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.memory import InvalidIds, LayoutError, OutOfMemory, PinnedError, TokenAllocator, UnifiedMemory
from hybridkv.memory.arena import Arena
from hybridkv.spec import FULL_POOL, ShardSpec, WindowPool, get_preset
from tests.memory.snapshots import assert_unchanged, snapshot


@pytest.fixture
def mem() -> UnifiedMemory:
    m = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-swa2-state")),
        300_000,
        page_size=4,
        max_context=64,
        chunk_tokens=16,
    )
    m.arena.buffer.copy_(torch.randint(0, 255, (m.arena.nbytes,), dtype=torch.uint8))
    return m


def assert_refused(mem: UnifiedMemory, error: type[Exception], match: str, call, *args) -> None:
    before = snapshot(mem)
    with pytest.raises(error, match=match):
        call(*args)
    assert_unchanged(before, mem)
    mem.verify()


def test_double_free_and_never_allocated(mem):
    row = TokenAllocator(mem).alloc(6)
    pages = np.unique(row // mem.page_size)
    mem.free_pages(pages[:1])
    assert_refused(mem, InvalidIds, "not allocated", mem.free_pages, pages)  # first is a double free
    assert_refused(mem, InvalidIds, "not allocated", mem.free_pages, [pages.max() + 5])
    assert_refused(mem, InvalidIds, "given twice", mem.free_pages, [pages[1], pages[1]])


def test_out_of_range_and_sink_ids(mem):
    TokenAllocator(mem).alloc(4)
    assert_refused(mem, InvalidIds, "outside", mem.free_pages, [10**9])
    assert_refused(mem, InvalidIds, "outside", mem.free_pages, [-3])
    assert_refused(mem, InvalidIds, "sink", mem.free_pages, [0])
    assert_refused(mem, InvalidIds, "integers", mem.free_pages, np.array([1.5]))
    assert_refused(mem, InvalidIds, "outside", mem.free_state, [10**9])


def test_free_segment_longer_than_the_row_or_misaligned(mem):
    row = TokenAllocator(mem).alloc(6)
    other = TokenAllocator(mem).alloc(3)
    too_long = np.concatenate([row, other])  # runs past the row into another row's page
    assert_refused(mem, InvalidIds, "longer than the row", TokenAllocator(mem).free_segment, too_long, 0)
    assert_refused(mem, InvalidIds, "offset", TokenAllocator(mem).free_segment, row[1:], 0)  # wrong start position
    past_end = np.concatenate([row, np.zeros(4, dtype=np.int64)])  # zero-filled table tail
    assert_refused(mem, InvalidIds, "segment", TokenAllocator(mem).free_segment, past_end, 0)


def test_bad_extend_and_decode_arguments(mem):
    row = TokenAllocator(mem).alloc(5)
    assert_refused(mem, InvalidIds, "one of each", TokenAllocator(mem).alloc_extend, [0], [3, 4], [0])
    assert_refused(mem, InvalidIds, "prefix_len", TokenAllocator(mem).alloc_extend, [5], [4], [row[-1]])
    assert_refused(mem, InvalidIds, "expected offset", TokenAllocator(mem).alloc_extend, [5], [9], [row[-2]])
    assert_refused(mem, InvalidIds, "live page", TokenAllocator(mem).alloc_decode, [7], [10**6])
    assert_refused(mem, InvalidIds, ">= 2", TokenAllocator(mem).alloc_decode, [1], [row[0]])


def test_window_misuse(mem):
    pages = mem.alloc_pages(2)
    mem.windows.free(pages[:1], WindowPool(8))
    assert_refused(mem, InvalidIds, "already left", mem.windows.free, pages[:1], WindowPool(8))
    assert_refused(mem, InvalidIds, "not a sliding-window pool", mem.windows.free, pages, FULL_POOL)
    assert_refused(mem, InvalidIds, "tombstoned", mem.windows.adopt, pages[1:], pages[1:], WindowPool(8))


def test_pinned_pages_cannot_be_freed(mem):
    pages = mem.alloc_pages(2)
    gate = mem.pin(pages=pages[:1])
    assert_refused(mem, PinnedError, "pinned", mem.free_pages, pages)
    gate.release()
    mem.free_pages(pages)
    mem.verify()


def test_out_of_memory_changes_nothing(mem):
    mem.alloc_pages(10)
    slots = mem.alloc_state(2)
    assert_refused(mem, OutOfMemory, "no free slab", mem.alloc_pages, mem.pages.capacity // 2)
    assert_refused(mem, OutOfMemory, "no free slab", mem.alloc_state, mem.slots.free_count)
    try:
        mem.alloc_pages(10**6)
    except OutOfMemory as exc:
        assert exc.short  # says what is short, for the cache's eviction
    mem.free_state(slots)
    mem.verify()


def test_budget_too_small_fails_at_start_naming_what_to_change():
    shard = ShardSpec.whole(get_preset("Qwen3-Next-80B-A3B-Instruct"))
    with pytest.raises(LayoutError, match=r"one request of 262144 tokens needs .* Raise the budget"):
        UnifiedMemory.create(shard, "4GiB", device="meta")
    mem = UnifiedMemory.create(shard, "4GiB", device="meta", max_context=32768)
    assert mem.stats().budget_bytes == 4 * 2**30


def test_host_ids_only():
    mem = UnifiedMemory.create(ShardSpec.whole(get_preset("tiny-dense")), 100_000, page_size=4, max_context=32)
    pages = mem.alloc_pages(1)
    mem.free_pages(torch.from_numpy(pages))  # CPU tensors are host memory: accepted
    assert mem.pages.live_count == 0
    with pytest.raises(TypeError, match="host ids"):
        mem.free_pages(torch.ones(1, dtype=torch.int64, device="meta"))


def test_a_double_free_inside_a_free_group_frees_nothing(mem):
    a, b = TokenAllocator(mem).alloc(6), TokenAllocator(mem).alloc(3)
    before = snapshot(mem)
    with pytest.raises(InvalidIds, match="given twice"), mem.free_group():
        TokenAllocator(mem).free_segment(a, 0)
        TokenAllocator(mem).free_segment(b, 0)
        TokenAllocator(mem).free(b)  # the same pages again
    assert_unchanged(before, mem)
    mem.verify()


def test_taking_more_cells_than_are_free_is_refused_with_the_package_error(mem):
    pages = mem.alloc_pages(2)
    mem.free_pages(pages[:1])  # the full pool keeps the slab, with a free cell in it
    pool = mem.pools[FULL_POOL]
    assert pool.free_count > 0
    assert_refused(mem, OutOfMemory, "reserve cells through the slab broker", pool.take_cells, pool.free_count + 1)
    owned = frozenset(int(s) for s in pool.owned_slabs())
    assert_refused(mem, OutOfMemory, "outside slabs", pool.take_cells, 1, owned)
    with pytest.raises(OutOfMemory) as refused:
        pool.take_cells(pool.free_count + 2)
    assert refused.value.short == {FULL_POOL: 2}


def test_views_of_a_caller_buffer_that_starts_inside_its_storage_address_that_buffer():
    """A shared arena is a slice past a header: every view must lie in the slice, never in the header."""
    arena = Arena(4096, 0, 1024, "cpu", buffer=torch.zeros(4096 + 512, dtype=torch.uint8)[512:])
    view = arena.strided_view(torch.float32, 4, 1024, 8, (2, 3))
    assert view.data_ptr() == arena.buffer.data_ptr() + 8
    view.fill_(1.0)
    assert int(arena.buffer.view(torch.float32)[2:8].sum()) == 6 and int(arena.buffer[:8].sum()) == 0
