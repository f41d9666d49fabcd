"""No hot-path call reads device memory from the host.

``HostSyncCounter`` counts every torch call that would block the host on a GPU (``.item()``,
``.tolist()``, ``bool(tensor)``, ``torch.unique``, ``nonzero``, scalar tensor assignment,
``.cpu()``/``.numpy()``...). The hot path runs under it and must count zero. On a machine
with CUDA the same calls also run under ``torch.cuda.set_sync_debug_mode("error")``
(``test_hot_path_on_cuda_under_sync_debug_mode``; and every ``host_sync`` test with
``HYBRIDKV_TEST_DEVICE=cuda``, ``tests/devices.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.host_sync import HostSyncCounter
from hybridkv.memory import OutOfMemory, TokenAllocator, UnifiedMemory
from hybridkv.spec import FULL_POOL, ShardSpec, get_preset
from tests.devices import device, no_host_sync


def hot_path(mem: UnifiedMemory) -> None:
    """Every hot-path call, including one that has to compact to find bytes."""
    ps = mem.page_size
    tokens = TokenAllocator(mem)
    rows = tokens.alloc_extend(np.zeros(3, np.int64), np.array([5, 9, 3]), np.zeros(3, np.int64))
    a, b, c = rows[:5], rows[5:14], rows[14:]
    more = tokens.alloc_extend(np.array([5, 3]), np.array([11, 4]), np.array([a[-1], c[-1]]))  # continues pages
    a, c = np.concatenate([a, more[:6]]), np.concatenate([c, more[6:]])
    d = tokens.alloc_decode(np.array([a.size + 1, b.size + 1]), np.array([a[-1], b[-1]]))
    a, b = np.append(a, d[0]), np.append(b, d[1])
    mem.translate(a)
    mem.translate(torch.from_numpy(b))
    mem.page_cells(a[::ps] // ps, FULL_POOL)
    if mem.window_pools:
        mem.windows.free(a[:ps:ps] // ps)
        holder, window = object(), mem.window_pools[0].pool_id  # window-cached: held, then reclaimed
        mem.pages.claim(holder, "a cache")
        mem.windows.hold(a[ps : 2 * ps : ps] // ps, window, by=holder)
        TokenAllocator(mem).free_segment(c, 0)  # a free while a window cell is held elsewhere
        c = TokenAllocator(mem).alloc(3)
        held = mem.windows.drop_holds(a[::ps] // ps, window, by=holder)
        mem.windows.free(a[::ps][held] // ps, window, by=holder)
    mem.windows.free_outside_span(a[::ps] // ps, a.size)
    slots = mem.alloc_state(2)
    forked = mem.fork_state(slots[:1])
    mem.free_state(np.concatenate([slots, forked]))
    TokenAllocator(mem).free_segment(a[ps:], ps)
    with mem.free_group():
        TokenAllocator(mem).free_segment(a[:ps], 0)
        TokenAllocator(mem).free(b)
    TokenAllocator(mem).free_segment(c, 0)
    # fill, keep one page in every slab, then ask for state: only compaction can make room
    filled = []
    while True:
        try:
            filled.append(mem.alloc_pages(1))
        except OutOfMemory:
            break
    pages = np.concatenate(filled)
    keep = set()
    for pool in mem.token_pools:
        slab_of = pool.cell_lo[pool.v2p[pages]]
        keep.update(pages[np.unique(slab_of, return_index=True)[1]].tolist())
    mem.free_pages(pages[~np.isin(pages, list(keep))])
    mem.alloc_state(3)
    mem.flush_tables()


@pytest.mark.host_sync
def test_hot_path_counts_zero_host_syncs():
    mem = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-swa2-state")),
        120_000,
        device(),
        page_size=2,
        max_context=16,
        chunk_tokens=8,
    )
    with no_host_sync() as counter:
        hot_path(mem)
    assert mem.stats().bytes_moved > 0, "the scenario was meant to exercise compaction"
    assert counter.total == 0, f"host syncs on the hot path: {dict(counter.counts)}"
    mem.verify()


def test_the_counter_sees_each_kind_of_sync():
    t = torch.arange(4)
    with HostSyncCounter() as counter:
        t.sum().item()
        t.tolist()
        bool(t[0] > 1)
        torch.unique(t)
        t.nonzero()
        t[0] = 5
    assert counter.counts["item"] == 1 and counter.counts["tolist"] == 1
    assert counter.counts["__bool__"] == 1 and counter.counts["unique"] == 1
    assert counter.counts["nonzero"] == 1 and counter.counts["scalar __setitem__"] == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hot_path_on_cuda_under_sync_debug_mode():
    mem = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-swa2-state")),
        120_000,
        device="cuda",
        page_size=2,
        max_context=16,
        chunk_tokens=8,
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hot_path(mem)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mem.verify()
