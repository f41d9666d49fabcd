"""UnifiedMemory: one byte budget per device for full KV, sliding-window KV and state.

Everything above this package holds *virtual* ids, in two typed id spaces (``IdSpace``):
- ``PAGE``: token locations ``loc = page * page_size + offset``, where ``page`` is a virtual
  page id shared by every token pool (full/MLA and each bounded-history pool, e.g. a
  sliding window, bind the same page id; a bounded pool's entry is a tombstone once that
  page left the span its history rule keeps);
- ``SLOT``: virtual state slots, one per request state (or prefix-cache checkpoint), shared
  by every slot pool.

Pools are keyed by their typed ``PoolId``; which pools keep every page (``history_pools``),
which may drop pages (``window_pools``) and which hold slots (``slot_pools``) follows from
each pool id's history rule, never from a name.

This module is the page API (whole virtual pages and state slots). The SGLang-style token API
(``alloc``, ``alloc_extend``, ``alloc_decode``, ``free``, ``free_segment``) is an adapter that
holds a memory (``tokens.TokenAllocator(mem)``). The window part is a part this memory owns
(window frees, adoption, window-cached cells: ``mem.windows``, ``windows.Windows``).
Argument checks are in ``ids.py``.

Invariants (``verify()`` proves them):
- Conservation: every arena byte is exactly one of sink, live cell, free cell, slab-edge
  waste, free slab or tail; cells of different pools never overlap.
- A live page is resident in every full-history pool; in a window pool it is resident or
  tombstoned. A free page is resident nowhere. A live slot is resident in every slot pool,
  a free one nowhere.
- Host tables are authoritative and the device tables mirror them. Hot-path calls (page
  and token alloc/free, free groups, state alloc/free/fork, translate) never read device
  memory: no ``.item()``, ``.tolist()``, ``bool(tensor)``, ``torch.unique``, ``nonzero`` or
  scalar tensor assignment. Capacity lives in host counters.
- A refused call (bad ids, pinned ids, ids a holder keeps, out of memory) changes nothing:
  arguments are checked before anything is reserved (``ids.py``: counts are ints >= 0; ids
  outside a table are refused, never wrapped; tensor ids are bounds-checked where the table
  lives, never read back).
- Ids the prefix cache keeps carry an owner mark (``VirtualIds.held``): only the cache frees
  them (``by=`` its holder); every other free of a marked id is refused.
- Window-cached cells (``mem.windows.hold``, see ``windows.py``) are refused by every
  free of their cell until the holder drops the mark (``mem.windows.drop_holds``).
- Compaction moves whole cells (all layers' bytes of a page or a state slot) and rebinds
  ``v2p``/``p2v``; it never moves a pinned id, and it runs only when a pool needs bytes
  that no hole and no free slab can give (or when asked to, e.g. when idle).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from hybridkv.memory.arena import Arena
from hybridkv.memory.errors import InvalidIds, OutOfMemory, PinnedError
from hybridkv.memory.gates import DoneEvent, GateRegistry, MoveGate
from hybridkv.memory.ids import EMPTY, IdsLike, bad_tensor_ids, check_range, count_arg, host_ids, select
from hybridkv.memory.layout import CellLayout
from hybridkv.memory.mirror import to_index
from hybridkv.memory.pool import SubPool
from hybridkv.memory.sizing import MemoryHints, MemoryPlan, plan_memory
from hybridkv.memory.slabs import SlabBroker
from hybridkv.memory.stats import MemoryStats, collect_stats
from hybridkv.memory.virtual import VirtualIds, distinct
from hybridkv.memory.windows import Windows
from hybridkv.spec import IdSpace, PoolId, ShardSpec
from hybridkv.units import parse_bytes


class UnifiedMemory:
    def __init__(
        self,
        plan: MemoryPlan,
        device: str | torch.device = "cpu",
        buffer: torch.Tensor | None = None,
    ):
        self.plan = plan
        self.shard = plan.shard
        self.page_size = plan.page_size
        self.arena = Arena(plan.budget_bytes, plan.sink_bytes, plan.slab_bytes, device, buffer)
        page_capacity = max(
            (self.arena.nbytes // lay.cell_bytes for lay in plan.layouts if lay.id_space is IdSpace.PAGE),
            default=-(-plan.max_context // plan.page_size) * 64,
        )
        slot_capacity = max(
            (self.arena.nbytes // lay.cell_bytes for lay in plan.layouts if lay.id_space is IdSpace.SLOT), default=2
        )
        self.pages = VirtualIds(IdSpace.PAGE, page_capacity)
        self.slots = VirtualIds(IdSpace.SLOT, slot_capacity)
        capacity = {IdSpace.PAGE: page_capacity, IdSpace.SLOT: slot_capacity}
        self.pools: dict[PoolId, SubPool] = {
            lay.pool_id: SubPool(index, lay, self.arena, capacity[lay.id_space])
            for index, lay in enumerate(plan.layouts)
        }
        self.token_pools = [p for p in self.pools.values() if p.layout.id_space is IdSpace.PAGE]
        self.history_pools = [p for p in self.token_pools if p.pool_id.keeps_history]
        self.window_pools = [p for p in self.token_pools if p.pool_id.releases_history]
        self.slot_pools = [p for p in self.pools.values() if p.layout.id_space is IdSpace.SLOT]
        self._cells_per_slab = [max(1, plan.min_cells_per_slab(p.layout)) for p in self.token_pools]
        self.gates = GateRegistry(page_capacity, slot_capacity)
        self.windows = Windows(
            self.page_size, self.pages, self.window_pools, self.gates, self._pool, self._check_releasable
        )
        self.broker = SlabBroker(self.arena, list(self.pools.values()), self.gates)
        self._group: list[np.ndarray] | None = None
        self._layer_pool: dict[int, SubPool] = {
            lid: pool for pool in self.pools.values() for lid in pool.layout.layer_ids
        }

    @classmethod
    def create(
        cls,
        shard: ShardSpec,
        budget: int | str,
        device: str | torch.device = "cpu",
        buffer: torch.Tensor | None = None,
        **hints: object,
    ) -> UnifiedMemory:
        """Plan and build in one call: ``UnifiedMemory.create(shard, "8GiB", page_size=16)``.

        ``buffer``: an existing 1-D uint8 tensor to use as the arena (e.g. shared memory).
        """
        plan = plan_memory(shard, parse_bytes(budget), MemoryHints(**hints))  # type: ignore[arg-type]
        return cls(plan, device, buffer)

    # --- geometry -------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.arena.device

    def layout(self, pool: PoolId) -> CellLayout:
        return self._pool(pool).layout

    def pool_of_layer(self, layer_id: int) -> SubPool:
        try:
            return self._layer_pool[layer_id]
        except KeyError:
            start, end = self.shard.bounds
            if not self.shard.has_layer(layer_id):
                raise KeyError(
                    f"layer {layer_id} is not on this shard ({self.shard.describe()}, layers [{start}, {end}))"
                ) from None
            raise KeyError(f"layer {layer_id} keeps no memory (an MLP-only layer)") from None

    def view(self, layer_id: int, tensor: str) -> torch.Tensor:
        """Strided view of one layer's tensor over the whole grid.

        KV: ``(cells, page_size, heads, head_dim)`` for ``"k"``/``"v"``; MLA: ``(cells,
        page_size, 1, kv_lora_rank + rope_dim)`` for ``"latent"``; state: ``(cells, *shape)``
        for each state tensor name. Index the first dim with ``translate``'s page cells.
        """
        return self.pool_of_layer(layer_id).view(layer_id, tensor)

    def geometry(self, layer_id: int) -> dict[str, object]:
        """This shard's geometry of one layer: kind, heads, dims, dtypes, pool id."""
        pool = self.pool_of_layer(layer_id)
        segs = [s for s in pool.layout.segments if s.layer_id == layer_id]
        return {
            "layer_id": layer_id,
            "pool": pool.pool_id,
            "kind": self.shard.local_kind(layer_id),
            "tensors": {s.tensor: (tuple(s.shape), s.dtype) for s in segs},
            "page_size": pool.layout.page_size,
        }

    def _pool(self, pool: PoolId) -> SubPool:
        if not isinstance(pool, PoolId):
            raise TypeError(
                f"pools are looked up by their typed PoolId, not {type(pool).__name__} {pool!r}; "
                f"pass PoolId.parse({str(pool)!r}) or a layout's pool_id"
            )
        try:
            return self.pools[pool]
        except KeyError:
            raise KeyError(f"no pool {pool} on this shard; pools: {[str(p) for p in self.pools]}") from None

    # --- capacity -------------------------------------------------------------------------

    def available_pages(self) -> int:
        """Pages surely allocatable now without compaction (host counters only).

        Every KV pool needs a cell per page and all draw on the same free slabs, so this is
        the largest ``k`` whose slab needs, summed over pools, fit the free slabs.
        """
        if not self.token_pools:
            return self.pages.free_count
        free_slabs = self.arena.free_slabs
        pools = zip(self.token_pools, self._cells_per_slab, strict=True)
        # each pool alone bounds k (its free cells and every free slab); often that bound fits them all
        hi = min(self.pages.free_count, *(p.free_count + free_slabs * n for p, n in pools))
        if self._slabs_for(hi) <= free_slabs:
            return hi
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._slabs_for(mid) <= free_slabs else (lo, mid - 1)
        return lo

    def pages_fit(self, count: int) -> bool:
        """``count <= available_pages()``, without searching for the largest count (host counters only)."""
        if count > self.pages.free_count:
            return False
        if all(count <= p.free_count for p in self.token_pools):  # free cells at hand in every pool
            return True
        return self._slabs_for(count) <= self.arena.free_slabs

    def _slabs_for(self, k: int) -> int:
        """Free slabs the token pools need, summed, for ``k`` more pages."""
        pools = zip(self.token_pools, self._cells_per_slab, strict=True)
        return sum(-(-max(0, k - p.free_count) // n) for p, n in pools)

    # --- pages: allocation ----------------------------------------------------------------

    def alloc_pages(self, count: int) -> np.ndarray:
        """``count`` fresh virtual pages, resident in every KV pool."""
        count = count_arg(count, "alloc_pages: count")
        if count == 0:
            return EMPTY.copy()
        if count > self.pages.free_count:
            raise OutOfMemory(
                f"{count} pages asked, {self.pages.free_count} virtual page ids free",
                {IdSpace.PAGE: count - self.pages.free_count},
            )
        cells = self.broker.take({p: count for p in self.token_pools})
        pages = self.pages.take(count)
        for pool, taken in cells.items():
            pool.bind(pages, taken)
        return pages

    # --- pages: release -------------------------------------------------------------------

    def free_pages(self, pages: IdsLike) -> None:
        """Free virtual pages (each once) in every pool, or buffer them inside a free group."""
        arr = host_ids(pages, "free_pages")
        if self._group is not None:
            self._group.append(arr.copy())  # checked together at the group's exit
            return
        self._release_pages(arr, "free_pages")

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """Batch frees: pages freed inside are checked at once and released together at exit.

        Inside, ``free``/``free_segment``/``free_pages`` only check each row's shape and buffer
        one id per page. At exit all buffered ids are checked together (a double free across
        rows is caught there) and released in one pass; a bad id, or an exception raised in
        the block, frees nothing. Nested groups join the outer one.
        """
        if self._group is not None:
            yield
            return
        self._group = []
        try:
            yield
            pages = np.concatenate(self._group) if self._group else EMPTY
        finally:
            self._group = None
        self._release_pages(pages, "free group")

    def _check_releasable(self, pages: np.ndarray, what: str, by: object = None, window: PoolId | None = None) -> None:
        """Live, not held (but by ``by``), not pinned, and no window cell held as window-cached
        (in ``window`` only, when only that pool's cells are freed)."""
        self.pages.check_live(pages, what)
        self.pages.check_not_held(pages, what, by)
        if self.windows.holds.total:
            self.windows.holds.refuse_held(pages, what, window)
        if pages.size and self.gates.pinning_gates and self.gates.page_pins[pages].any():
            first = int(pages[np.argmax(self.gates.page_pins[pages] > 0)])
            raise PinnedError(f"{what}: page {first} is pinned by a move gate (in-flight forward or transfer)")

    def _release_pages(self, pages: np.ndarray, what: str) -> None:
        self._check_releasable(pages, what)
        for pool in self.history_pools:  # a live page is resident in every history pool
            pool.give_cells(pool.unbind(pages))
        for pool in self.window_pools:
            resident = pool.resident(pages)
            here = pages if np.count_nonzero(resident) == pages.size else pages[resident]
            pool.give_cells(pool.unbind(here))
        self.pages.give_back(pages)

    # --- host tables -----------------------------------------------------------------------

    def host_cells(self, ids: IdsLike, pool: PoolId) -> np.ndarray:
        """Grid cells of virtual pages (or state slots) in ``pool``, from the host table.

        A copy; -1 marks a tombstone. For planners (e.g. transfers) that must not touch the
        device; kernels use ``page_cells``. Ids outside the pool's table are refused.
        """
        target = self._pool(pool)
        arr = host_ids(ids, "host_cells")
        check_range(arr, target.v2p.size, f"host_cells in {pool}", f"{target.layout.id_space.value} ids")
        return target.v2p[arr]

    def resident(self, pages: IdsLike, pool: PoolId) -> np.ndarray:
        """Host mask: which pages are resident in ``pool`` (tombstones are False)."""
        target = self._pool(pool)
        arr = host_ids(pages, "resident")
        check_range(arr, target.v2p.size, f"resident in {pool}", f"{target.layout.id_space.value} ids")
        return target.resident(arr)

    # --- state slots ----------------------------------------------------------------------

    def _check_slot_pools(self, what: str) -> None:
        if not self.slot_pools:
            raise InvalidIds(f"{what}: this shard ({self.shard.describe()}) has no recurrent layers")

    def alloc_state(self, count: int) -> np.ndarray:
        """``count`` fresh state slots, resident in every slot pool."""
        self._check_slot_pools("alloc_state")
        count = count_arg(count, "alloc_state: count")
        if count > self.slots.free_count:
            raise OutOfMemory(
                f"{count} state slots asked, {self.slots.free_count} ids free",
                {IdSpace.SLOT: count - self.slots.free_count},
            )
        cells = self.broker.take({pool: count for pool in self.slot_pools})
        slots = self.slots.take(count)
        for pool, taken in cells.items():
            pool.bind(slots, taken)
        return slots

    def free_state(self, slots: IdsLike) -> None:
        self._check_slot_pools("free_state")
        arr = host_ids(slots, "free_state")
        self.slots.check_live(arr, "free_state")
        self.slots.check_not_held(arr, "free_state")
        if arr.size and self.gates.slot_pins[arr].any():
            raise PinnedError("free_state: a slot is pinned by a move gate")
        for pool in self.slot_pools:
            pool.give_cells(pool.unbind(arr))
        self.slots.give_back(arr)

    def fork_state(self, slots: IdsLike) -> np.ndarray:
        """New slots holding copies of ``slots``' states (copy-on-write for prefix hits)."""
        self._check_slot_pools("fork_state")
        src = host_ids(slots, "fork_state")
        self.slots.check_live(src, "fork_state")
        if all(pool.free_count >= src.size for pool in self.slot_pools):
            new = self.alloc_state(src.size)  # free cells at hand: no compaction, nothing moves
        else:
            with self.pin(slots=src):  # compaction while reserving must not move the sources
                new = self.alloc_state(src.size)
        for pool in self.slot_pools:
            pool.copy_cells(pool.v2p[src], pool.v2p[new])
        return new

    # --- translation and pins -------------------------------------------------------------

    def translate(self, locs: IdsLike | torch.Tensor, pool: PoolId | None = None) -> torch.Tensor:
        """Virtual token locations -> physical token slots (``cell * page_size + offset``).

        Host ids are copied to the device asynchronously; device ids stay there. The result
        is a device tensor; tombstoned pages map to -1 * page_size + offset (< 0).

        Locations outside ``[0, capacity * page_size)`` are refused with ``InvalidIds``: host
        ids are checked on the host. Tensor ids are never read back (that would block the
        host on the device): the table lookup bounds-checks every id where the tables live,
        so on a CPU table the call raises ``InvalidIds``, and on a GPU a bad id stops the
        process with a device-side assert instead of aliasing another request's slots.
        """
        target = self._token_pool(pool)
        v2p = target.v2p_dev
        ps = self.page_size
        if isinstance(locs, torch.Tensor):
            loc_t = locs.to(device=v2p.device, dtype=torch.int64, non_blocking=True)
        else:
            arr = host_ids(locs, "translate")
            check_range(arr, v2p.numel() * ps, "translate", "token locations")
            loc_t = to_index(arr, v2p.device)
        try:
            cells = select(v2p, torch.div(loc_t, ps, rounding_mode="floor"))
        except IndexError:
            raise bad_tensor_ids(loc_t, v2p.numel() * ps, "translate", "token locations") from None
        return cells * ps + loc_t % ps

    def page_cells(self, pages: IdsLike | torch.Tensor, pool: PoolId) -> torch.Tensor:
        """Virtual page ids (or state slots) -> grid cells on the device, for page tables.

        Ids outside the pool's table are refused as in ``translate`` (host ids on the host;
        tensor ids by the bounds-checked lookup, with no host read).
        """
        target = self._pool(pool)
        v2p, noun = target.v2p_dev, f"{target.layout.id_space.value} ids"
        if isinstance(pages, torch.Tensor):
            index = pages.to(device=v2p.device, dtype=torch.int64, non_blocking=True)
        else:
            arr = host_ids(pages, "page_cells")
            if v2p.device.type != "cpu":  # a CPU table's lookup refuses bad ids itself (below)
                check_range(arr, v2p.numel(), f"page_cells in {pool}", noun)
            index = to_index(arr, v2p.device)
        try:
            return select(v2p, index)
        except IndexError:
            raise bad_tensor_ids(index, v2p.numel(), f"page_cells in {pool}", noun) from None

    def _token_pool(self, pool: PoolId | None) -> SubPool:
        if pool is not None:
            return self._pool(pool)
        if not self.history_pools:
            raise KeyError(f"name a pool: this shard has no full-history pool ({[str(p) for p in self.pools]})")
        return self.history_pools[0]

    def flush_tables(self) -> None:
        """Apply pending page-table updates to the device copies (asynchronous, no host read).

        Call once per step before kernels read ``v2p_dev``; ``translate``/``page_cells`` do it.
        (``p2v_dev`` is brought up to date when it is read: no kernel needs it every step.)
        """
        for pool in self.pools.values():
            pool.flush_tables()

    def pin(
        self, pages: IdsLike | None = None, slots: IdsLike | None = None, event: DoneEvent | None = None
    ) -> MoveGate:
        """Pin ids against moves and frees until ``release()`` (or until ``event`` completes)."""
        p = host_ids(pages if pages is not None else EMPTY, "pin pages")
        s = host_ids(slots if slots is not None else EMPTY, "pin slots")
        if p.size:
            self.pages.check_live(distinct(p), "pin")
        if s.size:
            self.slots.check_live(distinct(s), "pin")
        return self.gates.pin(p, s, event)

    # --- compaction -----------------------------------------------------------------------

    def compact(self, max_slabs: int | None = None) -> int:
        """Idle-time defragmentation; returns how many slabs went back to the free list."""
        return self.broker.compact(None if max_slabs is None else count_arg(max_slabs, "compact: max_slabs"))

    # --- reports --------------------------------------------------------------------------

    def stats(self) -> MemoryStats:
        """Bytes per pool (live, free, slab-edge waste, cell padding), sink, tail, moves."""
        return collect_stats(self)

    def verify(self) -> None:
        """Prove conservation and table consistency; raises AssertionError naming the fault.

        Reads device tables: a check for tests and debugging, not for the hot path.
        """
        from hybridkv.memory.verify import verify_memory

        verify_memory(self)
