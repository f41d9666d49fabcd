"""Stateful property test: random traffic against UnifiedMemory, checked after every step.

The machine drives requests through extend / decode / window drops / window-cached holds
(kept by a holder, dropped and freed in its name) / segment frees / free groups / state
alloc, fork and free / pins / compaction on small arenas (so pools fight
for slabs and compaction really moves cells). After every step:
- ``verify()`` (conservation and table consistency);
- the live pages equal exactly the pages the model's rows reference;
- every live page's cell (in every pool where it is resident) and every live slot's cell
  still starts with the tag written when it was allocated: moves carried the bytes along.
A refused call (OutOfMemory, PinnedError) must leave every table and byte unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.memory import InvalidIds, OutOfMemory, PinnedError, TokenAllocator, UnifiedMemory
from hybridkv.spec import ShardSpec, get_preset
from tests.memory.snapshots import assert_unchanged, snapshot

PRESETS = ["tiny-swa2-state", "tiny-swa", "tiny-gdn", "tiny-dense", "tiny-kda-mla", "tiny-mamba-mlp"]


class MemoryMachine(RuleBasedStateMachine):
    @initialize(
        preset=st.sampled_from(PRESETS),
        budget=st.integers(60_000, 160_000),
        page_size=st.sampled_from([1, 2, 4]),
    )
    def setup(self, preset: str, budget: int, page_size: int) -> None:
        shard = ShardSpec.whole(get_preset(preset))
        self.mem = UnifiedMemory.create(shard, budget, page_size=page_size, max_context=16, chunk_tokens=8)
        self.ps = page_size
        self.rows: dict[int, np.ndarray] = {}
        self.slots: dict[int, int] = {}
        self.window_dropped: dict[int, int] = {}  # rid -> pages dropped from window pools
        self.gates: list = []
        self.next_rid = 0
        self.holder = object()  # stands for the prefix cache, the one holder of window-cached cells
        self.mem.pages.claim(self.holder, "the test's cache")

    # --- helpers ------------------------------------------------------------------------------

    def _tag_pages(self, pages: np.ndarray) -> None:
        for pool in self.mem.token_pools:
            resident = pages[pool.resident(pages)]
            self._tag(pool, pool.v2p[resident], resident)

    def _tag(self, pool, cells: np.ndarray, tags: np.ndarray) -> None:
        grid = self.mem.arena.cell_grid(pool.grid_cells, pool.cell_bytes)
        for cell, tag in zip(cells, tags, strict=True):
            grid[int(cell), :8] = torch.tensor([int(tag)], dtype=torch.int64).view(torch.uint8)

    def _attempt(self, call, *args):
        """Run a call that may be refused; a refusal must change nothing."""
        before = snapshot(self.mem)
        try:
            return call(*args)
        except (OutOfMemory, PinnedError):
            assert_unchanged(before, self.mem)
            return None

    def _row_pages(self, rid: int) -> np.ndarray:
        row = self.rows[rid]
        return row[:: self.ps] // self.ps

    # --- rules --------------------------------------------------------------------------------

    @rule(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3), with_state=st.booleans())
    def prefill(self, lengths: list[int], with_state: bool) -> None:
        seq = np.array(lengths, dtype=np.int64)
        zeros = np.zeros_like(seq)
        locs = self._attempt(TokenAllocator(self.mem).alloc_extend, zeros, seq, zeros)
        if locs is None:
            return
        assert locs.size == seq.sum()
        for n, end in zip(seq, np.cumsum(seq), strict=True):
            rid = self.next_rid
            self.next_rid += 1
            self.rows[rid] = locs[end - n : end]
            self.window_dropped[rid] = 0
            self._tag_pages(self._row_pages(rid))
            if with_state and self.mem.slot_pools:
                slot = self._attempt(self.mem.alloc_state, 1)
                if slot is not None:
                    self.slots[rid] = int(slot[0])
                    for pool in self.mem.slot_pools:
                        self._tag(pool, pool.v2p[slot], slot)

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), grow=st.integers(1, 6))
    def extend(self, data, grow: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.rows)))
        row = self.rows[rid]
        assume(self.window_dropped[rid] == 0)
        new = self._attempt(TokenAllocator(self.mem).alloc_extend, [row.size], [row.size + grow], [row[-1]])
        if new is None:
            return
        self.rows[rid] = np.concatenate([row, new])
        self._tag_pages(np.unique(new // self.ps)[~np.isin(np.unique(new // self.ps), row // self.ps)])

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def decode(self, data) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, max_size=4, unique=True))
        rows = [self.rows[r] for r in rids]
        out = self._attempt(TokenAllocator(self.mem).alloc_decode, [r.size + 1 for r in rows], [r[-1] for r in rows])
        if out is None:
            return
        for rid, loc in zip(rids, out, strict=True):
            fresh = loc % self.ps == 0
            self.rows[rid] = np.append(self.rows[rid], loc)
            if fresh:
                self._tag_pages(np.array([loc // self.ps]))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def drop_window(self, data) -> None:
        """Pages that left every window (all but the last two pages) leave the window pools."""
        assume(self.mem.window_pools)
        rid = data.draw(st.sampled_from(sorted(self.rows)))
        pages = self._row_pages(rid)
        keep = 2
        start = self.window_dropped[rid]
        if pages.size - keep <= start:
            return
        gone = pages[start : pages.size - keep]
        self._unhold(rid)
        self._attempt(self.mem.windows.free, gone)
        if not self.mem.resident(gone, self.mem.window_pools[0].pool_id).any():
            self.window_dropped[rid] = pages.size - keep

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def hold_window(self, data) -> None:
        """The holder keeps the window cells of a row's pages that left the window (all but
        the last two pages); nobody else may free them."""
        assume(self.mem.window_pools)
        rid = data.draw(st.sampled_from(sorted(self.rows)))
        pool = data.draw(st.sampled_from(self.mem.window_pools))
        pages = self._row_pages(rid)[:-2]
        pages = pages[pool.resident(pages) & ~self.mem.windows.held(pool.pool_id)[pages]]
        if not pages.size:
            return
        self.mem.windows.hold(pages, pool.pool_id, by=self.holder)
        before = snapshot(self.mem)
        for call, args in [
            (self.mem.windows.free, (pages[:1], pool.pool_id)),
            (self.mem.free_pages, (pages[:1],)),
            (lambda *a: self.mem.windows.hold(*a, by=self.holder), (pages[:1], pool.pool_id)),
        ]:
            try:
                call(*args)
            except InvalidIds:
                assert_unchanged(before, self.mem)
            else:
                raise AssertionError(f"{call} of a window-cached cell was not refused")

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def reclaim_window(self, data) -> None:
        """The holder drops its hold on a row's window-cached cells and frees them (eviction)."""
        assume(self.mem.window_pools)
        rid = data.draw(st.sampled_from(sorted(self.rows)))
        pool = data.draw(st.sampled_from(self.mem.window_pools))
        pages = self._row_pages(rid)
        held = pages[self.mem.windows.drop_holds(pages, pool.pool_id, by=self.holder)]
        if held.size:
            self._attempt(lambda: self.mem.windows.free(held, pool.pool_id, by=self.holder))

    def _unhold(self, rid: int) -> None:
        """A row's pages are about to be freed: the holder drops its holds on them first."""
        for pool in self.mem.window_pools:
            self.mem.windows.drop_holds(self._row_pages(rid), pool.pool_id, by=self.holder)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def finish(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.rows)))
        self._unhold(rid)
        if self._attempt(TokenAllocator(self.mem).free_segment, self.rows[rid], 0) is None and self._pinned(rid):
            return
        self.rows.pop(rid)
        slot = self.slots.pop(rid, None)
        if slot is not None:
            self.mem.free_state([slot])

    @precondition(lambda self: len(self.rows) >= 2)
    @rule(data=st.data())
    def finish_group(self, data) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=2, max_size=3, unique=True))
        if any(self._pinned(r) for r in rids):
            return
        for rid in rids:
            self._unhold(rid)
        with self.mem.free_group():
            for rid in rids:
                TokenAllocator(self.mem).free_segment(self.rows[rid], 0)
        for rid in rids:
            self.rows.pop(rid)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        """Free a row's tail from a page boundary (e.g. a rejected speculative span)."""
        rid = data.draw(st.sampled_from(sorted(self.rows)))
        row = self.rows[rid]
        cut = data.draw(st.integers(1, row.size)) // self.ps * self.ps
        assume(0 < cut < row.size and not self._pinned(rid))
        self._unhold(rid)
        TokenAllocator(self.mem).free_segment(row[cut:], cut)
        self.rows[rid] = row[:cut]

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def fork(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.slots)))
        new = self._attempt(self.mem.fork_state, [self.slots[rid]])
        if new is None:
            return
        for pool in self.mem.slot_pools:
            grid = self.mem.arena.cell_grid(pool.grid_cells, pool.cell_bytes)
            src, dst = pool.v2p[self.slots[rid]], pool.v2p[new[0]]
            assert torch.equal(grid[int(src)], grid[int(dst)]), "fork did not copy the state bytes"
        self.mem.free_state(new)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def pin(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.rows)))
        slots = [self.slots[rid]] if rid in self.slots else []
        self.gates.append((rid, self.mem.pin(pages=np.unique(self._row_pages(rid)), slots=slots)))

    @precondition(lambda self: self.gates)
    @rule()
    def unpin(self) -> None:
        _, gate = self.gates.pop(0)
        gate.release()

    @rule()
    def compact(self) -> None:
        self.mem.compact()

    def _pinned(self, rid: int) -> bool:
        return any(r == rid for r, _ in self.gates)

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "mem"):
            return
        self.mem.verify()
        available = self.mem.available_pages()  # pages_fit answers the same question without the search
        for k in (0, available - 1, available, available + 1, available + 7):
            assert self.mem.pages_fit(k) == (k <= available), (k, available)
        referenced = set()
        for row in self.rows.values():
            referenced.update((row // self.ps).tolist())
        live = set(np.flatnonzero(self.mem.pages.live)[1:].tolist())
        assert live == referenced, f"live pages {sorted(live - referenced)} unreferenced"
        for pool in self.mem.token_pools:
            pages = np.array(sorted(live), dtype=np.int64)
            pages = pages[pool.resident(pages)] if pages.size else pages
            grid = self.mem.arena.cell_grid(pool.grid_cells, pool.cell_bytes)
            for page in pages:
                tag = grid[int(pool.v2p[page]), :8].view(torch.int64)
                assert int(tag[0]) == int(page), f"{pool.pool_id}: page {page} lost its bytes"
        for pool in self.mem.slot_pools:
            grid = self.mem.arena.cell_grid(pool.grid_cells, pool.cell_bytes)
            for slot in self.slots.values():
                assert int(grid[int(pool.v2p[slot]), :8].view(torch.int64)[0]) == slot

    def teardown(self) -> None:
        for _, gate in getattr(self, "gates", []):
            gate.release()


MemoryMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestMemoryMachine = MemoryMachine.TestCase
