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

Invariants (``verify()`` proves them):
- Conservation: every arena byte is exactly one of sink, live cell, free cell, slab-edge
  waste, free slab or tail; cells of different pools never overlap.
- A live page is resident in every full-history pool; in a window pool it is resident or
  tombstoned. A free page is resident nowhere. A live slot is resident in every slot pool,
  a free one nowhere.
- Host tables are authoritative and the device tables mirror them. Hot-path calls (alloc,
  alloc_extend, alloc_decode, free, free_segment, free groups, state alloc/free/fork,
  translate) never read device memory: no ``.item()``, ``.tolist()``, ``bool(tensor)``,
  ``torch.unique``, ``nonzero`` or scalar tensor assignment. Capacity lives in host counters.
- A refused call (bad ids, pinned ids, ids a holder keeps, out of memory) changes nothing. Arguments are
  checked before anything is reserved: counts, lengths and positions are ints >= 0
  (``bool`` and floats refused); ids outside a table are refused, never wrapped (a negative
  id would otherwise read another request's entries from the end of the table); two
  requests of one extend/decode batch may not continue the same partial page.
- Ids given as host arrays are checked on the host. Ids given as tensors are never read
  back: ``translate``/``page_cells`` look them up with a bounds-checked ``index_select``,
  which refuses an out-of-range or negative id where the table lives (``InvalidIds`` for a
  CPU table; a device-side assert, which stops the process, for a GPU table). So device ids
  are trusted to be in range, and a bad one fails loudly instead of aliasing.
- Ids the prefix cache keeps carry an owner mark (``VirtualIds.held``): only the cache frees
  them (``by=`` its holder); every other free of a marked id is refused.
- Window-cached cells: a request's page that left its window may keep its window cell, held
  by the page holder (``hold_window_pages``) until memory is needed: it is neither free nor
  needed by its request. Such a page is live, resident in that window pool and not held as
  a whole (a cached page's cells are the holder's anyway). Every free of a held window
  cell (window free, page free, adoption) is refused until the holder drops the mark
  (``drop_window_holds``); with no cell held, the free paths pay one counter read for it.
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
from hybridkv.memory.layout import CellLayout
from hybridkv.memory.mirror import to_index
from hybridkv.memory.pool import SubPool
from hybridkv.memory.sizing import MemoryHints, MemoryPlan, parse_bytes, plan_memory
from hybridkv.memory.slabs import SlabBroker
from hybridkv.memory.stats import MemoryStats, collect_stats
from hybridkv.memory.virtual import VirtualIds, distinct
from hybridkv.spec import IdSpace, PoolId, ShardSpec

_EMPTY = np.empty(0, dtype=np.int64)

IdsLike = np.ndarray | list[int] | torch.Tensor


def _host_ids(ids: IdsLike | np.ndarray, what: str) -> np.ndarray:
    """Accept host ids only: a device tensor here would need a blocking read."""
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
        return ids
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise TypeError(
                f"{what}: pass host ids (numpy or CPU); reading a {ids.device} tensor would "
                "block the host on the device"
            )
        ids = ids.numpy()
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidIds(f"{what}: ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)


def _count(value: object, what: str) -> int:
    """A count (or length, position) argument: a Python or numpy integer >= 0.

    Checked before anything is reserved: a float or bool would otherwise fail only after
    slabs were acquired for it.
    """
    if type(value) is int and value >= 0:  # the common case, first
        return value
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise InvalidIds(f"{what} must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise InvalidIds(f"{what} must be >= 0, got {value}")
    return int(value)


def _out_of_range(bad: np.ndarray, limit: int, what: str, noun: str) -> InvalidIds:
    shown = ", ".join(str(int(i)) for i in bad[:5]) + (f", ... ({bad.size} in all)" if bad.size > 5 else "")
    return InvalidIds(f"{what}: {noun} [{shown}] outside the valid range 0..{limit - 1}")


def _check_range(ids: np.ndarray, limit: int, what: str, noun: str) -> None:
    """Host ids must lie in ``[0, limit)``: a negative id would index from the end of a
    table (another request's entries), a large one past it."""
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        raise _out_of_range(ids[(ids < 0) | (ids >= limit)], limit, what, noun)


def _select(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` where every index is bounds-checked, negatives included (plain
    indexing would wrap a negative id to the end of the table). The check runs where the
    table lives: a CPU table raises ``IndexError`` at once; on a GPU an out-of-range id is a
    device-side assert (the process stops; it never reads another request's entries)."""
    return table.index_select(0, index.reshape(-1)).view(index.shape)


def _bad_tensor_ids(ids: torch.Tensor, limit: int, what: str, noun: str) -> InvalidIds:
    """The error for tensor ids a CPU table refused (the ids are host memory: reading them
    on this error path blocks nothing)."""
    flat = ids.reshape(-1)
    return _out_of_range(flat[(flat < 0) | (flat >= limit)].numpy(), limit, what, noun)


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
        self._page_mark = np.zeros(page_capacity, dtype=np.int64)  # scratch of _check_tails
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
        self._window_held = {p.pool_id: np.zeros(page_capacity, dtype=bool) for p in self.window_pools}
        self._window_held_count = dict.fromkeys(self._window_held, 0)
        self._window_held_total = 0
        self.gates = GateRegistry(page_capacity, slot_capacity)
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
        per_slab = [max(1, self.plan.min_cells_per_slab(p.layout)) for p in self.token_pools]

        def fits(k: int) -> bool:
            need = sum(-(-max(0, k - p.free_count) // n) for p, n in zip(self.token_pools, per_slab, strict=True))
            return need <= free_slabs

        lo, hi = 0, self.pages.free_count
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # --- pages: allocation ----------------------------------------------------------------

    def alloc_pages(self, count: int) -> np.ndarray:
        """``count`` fresh virtual pages, resident in every KV pool."""
        count = _count(count, "alloc_pages: count")
        if count == 0:
            return _EMPTY.copy()
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

    def alloc(self, num_tokens: int) -> np.ndarray:
        """Token locations for ``num_tokens`` tokens on fresh pages."""
        num_tokens = _count(num_tokens, "alloc: num_tokens")
        pages = self.alloc_pages(-(-num_tokens // self.page_size))
        ps = self.page_size
        return (pages[:, None] * ps + np.arange(ps)).reshape(-1)[:num_tokens]

    def alloc_extend(self, prefix_lens: IdsLike, seq_lens: IdsLike, last_locs: IdsLike) -> np.ndarray:
        """Batched prefill: request ``i`` grows from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens.

        ``last_locs[i]`` is the location of token ``prefix_lens[i] - 1`` (ignored when the
        prefix is empty); new tokens first fill that token's page, then fresh pages.
        Returns the new tokens' locations, request after request.
        """
        ps = self.page_size
        prefix = _host_ids(prefix_lens, "alloc_extend prefix_lens")
        seq = _host_ids(seq_lens, "alloc_extend seq_lens")
        last = _host_ids(last_locs, "alloc_extend last_locs")
        if not prefix.size == seq.size == last.size:
            raise InvalidIds(
                f"alloc_extend: {prefix.size} prefix_lens, {seq.size} seq_lens, {last.size} "
                "last_locs; give one of each per request"
            )
        if (prefix < 0).any() or (seq < prefix).any():
            i = int(np.argmax((prefix < 0) | (seq < prefix)))
            raise InvalidIds(
                f"alloc_extend: request {i} has prefix_len {prefix[i]} and seq_len {seq[i]}; "
                "need 0 <= prefix_len <= seq_len"
            )
        self._check_tails(last, prefix, seq > prefix, "alloc_extend")
        old_pages = -(-prefix // ps)
        new_pages_per = -(-seq // ps) - old_pages
        pages = self.alloc_pages(int(new_pages_per.sum()))
        if not np.count_nonzero(prefix % ps):
            return self._fresh_page_tokens(pages, new_pages_per, seq)
        counts = seq - prefix
        req = np.repeat(np.arange(seq.size), counts)
        starts = np.cumsum(counts) - counts
        pos = prefix[req] + (np.arange(req.size) - starts[req])
        page_index = pos // ps - old_pages[req]
        first_new = np.cumsum(new_pages_per) - new_pages_per
        page = last[req] // ps  # tokens that continue the request's last page
        fresh = page_index >= 0
        page[fresh] = pages[first_new[req[fresh]] + page_index[fresh]]
        return page * ps + pos % ps

    def _fresh_page_tokens(self, pages: np.ndarray, pages_per: np.ndarray, seq: np.ndarray) -> np.ndarray:
        """Token locations when every request starts on a page boundary (no continuation)."""
        ps = self.page_size
        grid = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
        tail = seq % ps
        ragged = (pages_per > 0) & (tail > 0)
        if not np.count_nonzero(ragged):
            return grid
        valid = np.full(pages.size, ps, dtype=np.int64)
        valid[(np.cumsum(pages_per) - 1)[ragged]] = tail[ragged]
        return grid[(np.arange(ps) < valid[:, None]).reshape(-1)]

    def alloc_decode(self, seq_lens: IdsLike, last_locs: IdsLike) -> np.ndarray:
        """Batched decode: one token per request; ``seq_lens`` include the new token."""
        ps = self.page_size
        seq = _host_ids(seq_lens, "alloc_decode seq_lens")
        last = _host_ids(last_locs, "alloc_decode last_locs")
        if seq.size != last.size:
            raise InvalidIds(f"alloc_decode: {seq.size} seq_lens but {last.size} last_locs")
        if seq.size and seq.min() < 2:
            raise InvalidIds("alloc_decode: every seq_len must be >= 2 (a prompt token and the new one)")
        self._check_tails(last, seq - 1, None, "alloc_decode")
        new_page = (seq - 1) % ps == 0
        pages = self.alloc_pages(int(np.count_nonzero(new_page)))
        out = last + 1
        out[new_page] = pages * ps
        return out

    def _check_tails(self, last: np.ndarray, lengths: np.ndarray, grows: np.ndarray | None, what: str) -> None:
        """Rows with ``lengths[i] > 0`` continue a row whose last token is at ``last[i]``.

        ``last[i]`` must be a live location at offset ``(lengths[i] - 1) % page_size``, and no
        two such rows may end on the same page where one of them writes into it (its page is
        partial and it grows: ``grows[i]``, or every row when None): both would be handed
        the same slots, or one would overwrite the other's tokens. (A shared prefix shares
        full pages only, or copies the partial one.)
        """
        has = lengths > 0
        count = np.count_nonzero(has)
        if not count:
            return
        whole = count == has.size
        loc, n = (last, lengths) if whole else (last[has], lengths[has])
        ps = self.page_size
        pages = loc // ps
        in_range = pages.min() > 0 and pages.max() < self.pages.capacity
        if not (in_range and self.pages.live[pages].all() and not np.count_nonzero(loc % ps != (n - 1) % ps)):
            bad = (pages <= 0) | (pages >= self.pages.capacity)
            bad |= ~bad & ~self.pages.live[np.where(bad, 0, pages)]
            bad |= loc % ps != (n - 1) % ps
            i = int(np.argmax(bad))
            raise InvalidIds(
                f"{what}: last location {loc[i]} does not hold token {n[i] - 1} of a live page "
                f"(page {pages[i]}, offset {loc[i] % self.page_size}, expected offset "
                f"{(n[i] - 1) % self.page_size})"
            )
        if count < 2:
            return
        # distinct pages <=> each row reads back its own index (no sort); a repeated page
        # keeps one of its rows' indices, so the others read back another
        order = np.arange(count)
        self._page_mark[pages] = order
        if not np.count_nonzero(self._page_mark[pages] != order):
            return
        writes = n % ps > 0
        if grows is not None:
            writes &= grows if whole else grows[has]
        self._refuse_shared_tail(pages, np.flatnonzero(has), writes, last, what)

    @staticmethod
    def _refuse_shared_tail(
        pages: np.ndarray, rows: np.ndarray, writes: np.ndarray, last: np.ndarray, what: str
    ) -> None:
        """Raise for the first two rows that end on one page while one of them writes into it
        (rows that end on the same full page and both start fresh pages share nothing)."""
        order = np.argsort(pages, kind="stable")
        same = pages[order][1:] == pages[order][:-1]
        clash = same & (writes[order][1:] | writes[order][:-1])
        if not clash.any():
            return
        k = int(np.argmax(clash))
        first, second = sorted((int(rows[order[k]]), int(rows[order[k + 1]])))
        raise InvalidIds(
            f"{what}: requests {first} and {second} both continue page {pages[order[k]]} (last locations "
            f"{last[first]} and {last[second]}), so they would get the same slots; two requests cannot "
            "continue the same partial page: give one of them its own copy of the page first"
        )

    # --- pages: release -------------------------------------------------------------------

    def free_pages(self, pages: IdsLike) -> None:
        """Free virtual pages (each once) in every pool, or buffer them inside a free group."""
        arr = _host_ids(pages, "free_pages")
        if self._group is not None:
            self._group.append(arr.copy())  # checked together at the group's exit
            return
        self._release_pages(arr, "free_pages")

    def free(self, locs: IdsLike) -> None:
        """Free the pages that hold ``locs`` (any tokens of them, in any order)."""
        arr = _host_ids(locs, "free")
        self.free_pages(distinct(arr // self.page_size))

    def free_segment(self, locs: IdsLike, start_pos: int) -> None:
        """Free one request's row from position ``start_pos``: ``locs`` are its tokens there.

        Frees every page whose first position is ``>= start_pos``, found from one
        representative per page (``locs[k::page_size]``), never by sorting. The segment
        must end where the row ends or on a page boundary, else a page still in use would
        be freed; every token is checked against its expected page offset, so a segment
        longer than the row (or from another row) is refused.
        """
        arr = _host_ids(locs, "free_segment")
        ps = self.page_size
        start_pos = _count(start_pos, "free_segment: start_pos")
        if arr.size == 0:
            return
        # loc - pos is page * ps - (first position of the page): a multiple of ps, constant
        # within a page, so it may only change where a page starts
        pos = start_pos + np.arange(arr.size)
        shift = arr - pos
        changes = np.flatnonzero(shift[1:] != shift[:-1]) + 1
        if np.count_nonzero(shift % ps) or np.count_nonzero(pos[changes] % ps) or arr.min() < 0:
            pages = arr // ps
            bad = (arr < 0) | (arr % ps != pos % ps)
            bad[1:] |= ((pos[1:] // ps) == (pos[:-1] // ps)) & (pages[1:] != pages[:-1])
            i = int(np.argmax(bad))
            raise InvalidIds(
                f"free_segment: token {i} (row position {pos[i]}) has location {arr[i]}, not "
                f"offset {pos[i] % ps} of the page its neighbours use; the segment is longer "
                "than the row, misaligned, or mixes rows"
            )
        head = (-start_pos) % ps
        self.free_pages(arr[head::ps] // ps)

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
            pages = np.concatenate(self._group) if self._group else _EMPTY
        finally:
            self._group = None
        self._release_pages(pages, "free group")

    def _check_releasable(self, pages: np.ndarray, what: str, by: object = None, window: PoolId | None = None) -> None:
        """Live, not held (but by ``by``), not pinned, and no window cell held as window-cached
        (in ``window`` only, when only that pool's cells are freed)."""
        self.pages.check_live(pages, what)
        self.pages.check_not_held(pages, what, by)
        if self._window_held_total:
            self._check_no_window_held(pages, what, window)
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

    def free_window_pages(self, pages: IdsLike, pool: PoolId | None = None, *, by: object = None) -> None:
        """Drop pages from bounded-history (window) pools only; full KV stays.

        ``pool`` names one window pool; default: every window pool where they are resident.
        Pages must be live; in a named pool they must be resident. ``by``: the holder of
        marked pages (``VirtualIds.claim``), which alone may drop their windows.
        """
        arr = _host_ids(pages, "free_window_pages")
        self._check_releasable(arr, "free_window_pages", by, pool)
        targets = [self._pool(pool)] if pool is not None else self.window_pools
        if pool is not None and not pool.releases_history:
            raise InvalidIds(f"free_window_pages: pool {pool} keeps its whole history; it is not a sliding-window pool")
        masks = [target.resident(arr) for target in targets]
        counts = [np.count_nonzero(mask) for mask in masks]
        if pool is not None and counts[0] != arr.size:
            raise InvalidIds(f"free_window_pages: page {arr[np.argmax(~masks[0])]} already left window pool {pool}")
        for target, resident, count in zip(targets, masks, counts, strict=True):
            target.give_cells(target.unbind(arr if count == arr.size else arr[resident]))

    def free_outside_span(self, row_pages: IdsLike, seq_len: int) -> None:
        """Release, in every window pool, the row's pages that lie wholly before the span its
        history rule needs at ``seq_len`` (``PoolId.first_needed``); pages already released
        there are skipped. ``row_pages``: one request's virtual pages in row order (page
        ``k`` holds positions ``[k * page_size, (k + 1) * page_size)``), all live.
        """
        arr = _host_ids(row_pages, "free_outside_span")
        ps = self.page_size
        seq_len = _count(seq_len, "free_outside_span: seq_len")
        if arr.size < -(-seq_len // ps):
            raise InvalidIds(
                f"free_outside_span: a row of {arr.size} pages cannot hold {seq_len} tokens of {ps} a page"
            )
        self.pages.check_live(arr, "free_outside_span")
        self.pages.check_not_held(arr, "free_outside_span")
        releases = []
        for pool in self.window_pools:
            behind = arr[: pool.pool_id.page_span(seq_len, ps)[0]]
            releases.append((pool, behind[pool.resident(behind)]))
        for pool, pages in releases:  # decide, then act: a pinned or window-cached page refuses the whole call
            if self._window_held_total:
                self._check_no_window_held(pages, "free_outside_span", pool.pool_id)
            if pages.size and self.gates.pinning_gates and self.gates.page_pins[pages].any():
                first = int(pages[np.argmax(self.gates.page_pins[pages] > 0)])
                raise PinnedError(
                    f"free_outside_span: page {first} is pinned by a move gate (in-flight forward or transfer)"
                )
        for pool, pages in releases:
            if pages.size:
                pool.give_cells(pool.unbind(pages))

    # --- window-cached cells --------------------------------------------------------------

    def hold_window_pages(self, pages: IdsLike, pool: PoolId, *, by: object) -> None:
        """The page holder ``by`` keeps the window cells of ``pages`` in ``pool`` (window-cached):
        pages that left their request's window, resident until the holder frees them.

        ``pages`` must be live, not held whole, resident in ``pool`` and not held there yet;
        only the holder of page ids (``VirtualIds.claim``) may hold window cells.
        """
        arr = _host_ids(pages, "hold_window_pages")
        target = self._pool(pool)
        if not pool.releases_history:
            raise InvalidIds(f"hold_window_pages: pool {pool} keeps its whole history; it is not a window pool")
        if by is None or by is not self.pages.holder:
            raise InvalidIds(
                "hold_window_pages: only the holder of page ids (the prefix cache, VirtualIds.claim) may "
                "hold window cells; pass by=<that holder>"
            )
        self.pages.check_live(arr, "hold_window_pages")
        self.pages.check_not_held(arr, "hold_window_pages")
        marks = self._window_held[pool]
        bad = ~target.resident(arr) | marks[arr]
        if np.count_nonzero(bad):
            page = int(arr[np.argmax(bad)])
            state = "already held" if marks[page] else "not resident"
            raise InvalidIds(f"hold_window_pages: page {page} is {state} in window pool {pool}")
        marks[arr] = True
        self._window_held_count[pool] += arr.size
        self._window_held_total += arr.size

    def drop_window_holds(self, pages: IdsLike, pool: PoolId, *, by: object) -> np.ndarray:
        """The holder ``by`` gives up its hold on the window cells of those ``pages`` it holds in
        ``pool`` (the others are skipped; the cells stay resident); returns their mask."""
        arr = _host_ids(pages, "drop_window_holds")
        if by is None or by is not self.pages.holder:
            raise InvalidIds("drop_window_holds: only the holder that held the window cells may drop them")
        marks = self._window_held.get(pool)
        if marks is None:
            raise InvalidIds(f"drop_window_holds: {pool} is not a window pool of this memory")
        _check_range(arr, marks.size, "drop_window_holds", "page ids")
        held = marks[arr]
        count = int(np.count_nonzero(held))
        if count:
            marks[arr[held]] = False
            self._window_held_count[pool] -= count
            self._window_held_total -= count
        return held

    def window_held(self, pool: PoolId) -> np.ndarray:
        """Read-only host mask over page ids: whose window cell in ``pool`` the holder keeps."""
        marks = self._window_held[pool].view()
        marks.flags.writeable = False
        return marks

    def window_held_count(self, pool: PoolId) -> int:
        """Window cells of ``pool`` held as window-cached (a host counter)."""
        return self._window_held_count[pool]

    def _check_no_window_held(self, pages: np.ndarray, what: str, only: PoolId | None = None) -> None:
        for pool, marks in self._window_held.items():
            if (only is None or pool == only) and self._window_held_count[pool] and np.count_nonzero(marks[pages]):
                page = int(pages[np.argmax(marks[pages])])
                raise InvalidIds(
                    f"{what}: the window cell of page {page} in {pool} is window-cached, held by "
                    f"{self.pages.holder_name}; its holder drops the hold first (KVManager.release does)"
                )

    def adopt_window_pages(self, src: IdsLike, dst: IdsLike, pool: PoolId) -> None:
        """Move window residency from pages ``src`` to pages ``dst`` (pairwise), no bytes copied.

        For a prefix cache that keeps ``dst`` (full KV) but lost their window pages, while a
        request just computed the same tokens into ``src``: ``dst`` takes ``src``'s window
        cells, ``src`` becomes tombstoned in that pool.
        """
        s, d = _host_ids(src, "adopt_window_pages src"), _host_ids(dst, "adopt_window_pages dst")
        target = self._pool(pool)
        if not pool.releases_history or s.size != d.size:
            raise InvalidIds(
                f"adopt_window_pages: need a window pool and equal lengths (pool {pool}, {s.size} src, {d.size} dst)"
            )
        self._check_releasable(s, "adopt_window_pages src", window=pool)
        self.pages.check_live(d, "adopt_window_pages dst")
        if not target.resident(s).all() or target.resident(d).any():
            raise InvalidIds(
                f"adopt_window_pages: every src page must be resident and every dst page tombstoned in {pool}"
            )
        target.bind(d, target.unbind(s))

    def host_cells(self, ids: IdsLike, pool: PoolId) -> np.ndarray:
        """Grid cells of virtual pages (or state slots) in ``pool``, from the host table.

        A copy; -1 marks a tombstone. For planners (e.g. transfers) that must not touch the
        device; kernels use ``page_cells``. Ids outside the pool's table are refused.
        """
        target = self._pool(pool)
        arr = _host_ids(ids, "host_cells")
        _check_range(arr, target.v2p.size, f"host_cells in {pool}", f"{target.layout.id_space.value} ids")
        return target.v2p[arr]

    def resident(self, pages: IdsLike, pool: PoolId) -> np.ndarray:
        """Host mask: which pages are resident in ``pool`` (tombstones are False)."""
        target = self._pool(pool)
        arr = _host_ids(pages, "resident")
        _check_range(arr, target.v2p.size, f"resident in {pool}", f"{target.layout.id_space.value} ids")
        return target.resident(arr)

    # --- state slots ----------------------------------------------------------------------

    def _check_slot_pools(self, what: str) -> None:
        if not self.slot_pools:
            raise InvalidIds(f"{what}: this shard ({self.shard.describe()}) has no recurrent layers")

    def alloc_state(self, count: int) -> np.ndarray:
        """``count`` fresh state slots, resident in every slot pool."""
        self._check_slot_pools("alloc_state")
        count = _count(count, "alloc_state: count")
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
        arr = _host_ids(slots, "free_state")
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
        src = _host_ids(slots, "fork_state")
        self.slots.check_live(src, "fork_state")
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
            arr = _host_ids(locs, "translate")
            _check_range(arr, v2p.numel() * ps, "translate", "token locations")
            loc_t = to_index(arr, v2p.device)
        try:
            cells = _select(v2p, torch.div(loc_t, ps, rounding_mode="floor"))
        except IndexError:
            raise _bad_tensor_ids(loc_t, v2p.numel() * ps, "translate", "token locations") from None
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
            arr = _host_ids(pages, "page_cells")
            _check_range(arr, v2p.numel(), f"page_cells in {pool}", noun)
            index = to_index(arr, v2p.device)
        try:
            return _select(v2p, index)
        except IndexError:
            raise _bad_tensor_ids(index, v2p.numel(), f"page_cells in {pool}", noun) from None

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
        p = _host_ids(pages if pages is not None else _EMPTY, "pin pages")
        s = _host_ids(slots if slots is not None else _EMPTY, "pin slots")
        if p.size:
            self.pages.check_live(distinct(p), "pin")
        if s.size:
            self.slots.check_live(distinct(s), "pin")
        return self.gates.pin(p, s, event)

    # --- compaction -----------------------------------------------------------------------

    def compact(self, max_slabs: int | None = None) -> int:
        """Idle-time defragmentation; returns how many slabs went back to the free list."""
        return self.broker.compact(None if max_slabs is None else _count(max_slabs, "compact: max_slabs"))

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
