"""The window part of the memory: pages leaving bounded-history pools, and window-cached cells.

``Windows`` (``mem.windows``, a part ``UnifiedMemory`` owns, handed the pieces it works on:
the page ids, the pool lookup, the move gates and the memory's releasability check) frees
window cells of live pages (``free``, ``free_outside_span``), moves window residency
between pages (``adopt``), and lets the page holder keep cells that left a window
(``hold`` / ``drop_holds``). ``WindowHolds`` (``mem.windows.holds``) is that hold: a
request's page that left its window may keep its cell in a window pool, held by the page
holder (the prefix cache, ``VirtualIds.claim``) until memory is needed: it is neither free
nor needed by its request.

Invariants (``UnifiedMemory.verify`` proves them):
- A held cell's page is live, resident in that window pool and not held as a whole (a
  cached page's cells are the holder's anyway); ``counts[pool]`` and ``total`` equal the marks.
- Every free of a held window cell (window free, page free, adoption) is refused
  (``refuse_held``) until the holder drops the mark; with no cell held, the free paths pay
  one counter read for it.
- Only the holder of page ids holds or drops; a page pinned by a move gate is not released;
  a refused call changes nothing (decide, then act).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hybridkv.memory.errors import InvalidIds, PinnedError
from hybridkv.memory.gates import GateRegistry
from hybridkv.memory.ids import IdsLike, check_range, count_arg, host_ids
from hybridkv.memory.pool import SubPool
from hybridkv.memory.virtual import VirtualIds
from hybridkv.spec import PoolId


class WindowHolds:
    def __init__(self, pages: VirtualIds, window_pools: list[SubPool]):
        self.pages = pages
        self.pools = {p.pool_id: p for p in window_pools}
        self.marks = {pool: np.zeros(pages.capacity, dtype=bool) for pool in self.pools}
        self.counts = dict.fromkeys(self.pools, 0)
        self.total = 0
        """Held cells over every window pool (a host counter)."""

    def hold(self, arr: np.ndarray, pool: PoolId, by: object) -> None:
        """``by`` keeps the window cells of pages ``arr`` in ``pool``: live, not held whole,
        resident there and not held yet; only the holder of page ids may hold."""
        target = self.pools.get(pool)
        if target is None:
            raise InvalidIds(f"windows.hold: pool {pool} keeps its whole history; it is not a window pool")
        if by is None or by is not self.pages.holder:
            raise InvalidIds(
                "windows.hold: only the holder of page ids (the prefix cache, VirtualIds.claim) may "
                "hold window cells; pass by=<that holder>"
            )
        self.pages.check_live(arr, "windows.hold")
        self.pages.check_not_held(arr, "windows.hold")
        marks = self.marks[pool]
        bad = ~target.resident(arr) | marks[arr]
        if np.count_nonzero(bad):
            page = int(arr[np.argmax(bad)])
            state = "already held" if marks[page] else "not resident"
            raise InvalidIds(f"windows.hold: page {page} is {state} in window pool {pool}")
        marks[arr] = True
        self.counts[pool] += arr.size
        self.total += arr.size

    def drop(self, arr: np.ndarray, pool: PoolId, by: object) -> np.ndarray:
        """``by`` gives up its hold on those pages of ``arr`` it holds in ``pool`` (the others
        are skipped; the cells stay resident); returns their mask."""
        if by is None or by is not self.pages.holder:
            raise InvalidIds("windows.drop_holds: only the holder that held the window cells may drop them")
        marks = self.marks.get(pool)
        if marks is None:
            raise InvalidIds(f"windows.drop_holds: {pool} is not a window pool of this memory")
        check_range(arr, marks.size, "windows.drop_holds", "page ids")
        held = marks[arr]
        count = int(np.count_nonzero(held))
        if count:
            marks[arr[held]] = False
            self.counts[pool] -= count
            self.total -= count
        return held

    def mask(self, pool: PoolId) -> np.ndarray:
        """Read-only host mask over page ids: whose window cell in ``pool`` is held."""
        marks = self.marks[pool].view()
        marks.flags.writeable = False
        return marks

    def refuse_held(self, pages: np.ndarray, what: str, only: PoolId | None = None) -> None:
        """Refuse (``InvalidIds``) when a window cell of ``pages`` is held (in ``only``, when given)."""
        for pool, marks in self.marks.items():
            if (only is None or pool == only) and self.counts[pool] and np.count_nonzero(marks[pages]):
                page = int(pages[np.argmax(marks[pages])])
                raise InvalidIds(
                    f"{what}: the window cell of page {page} in {pool} is window-cached, held by "
                    f"{self.pages.holder_name}; its holder drops the hold first (KVManager.release does)"
                )


Releasable = Callable[[np.ndarray, str, object, "PoolId | None"], None]
"""``UnifiedMemory``'s check that pages may leave a pool: live, not held but by ``by``, not pinned, no window
cell held (in the pool named)."""


class Windows:
    """Window calls over one memory's window pools (``mem.windows``)."""

    def __init__(
        self,
        page_size: int,
        pages: VirtualIds,
        window_pools: list[SubPool],
        gates: GateRegistry,
        lookup: Callable[[PoolId], SubPool],
        releasable: Releasable,
    ):
        """``lookup``: the memory's pool of a ``PoolId`` (a clear error for one it does not have)."""
        self.page_size = page_size
        self.pages = pages
        self.window_pools = window_pools
        self.gates = gates
        self._pool = lookup
        self._check_releasable = releasable
        self.holds = WindowHolds(pages, window_pools)

    def free(self, pages: IdsLike, pool: PoolId | None = None, *, by: object = None) -> None:
        """Drop pages from bounded-history (window) pools only; full KV stays.

        ``pool`` names one window pool; default: every window pool where they are resident.
        Pages must be live; in a named pool they must be resident. ``by``: the holder of
        marked pages (``VirtualIds.claim``), which alone may drop their windows.
        """
        arr = host_ids(pages, "windows.free")
        self._check_releasable(arr, "windows.free", by, pool)
        targets = [self._pool(pool)] if pool is not None else self.window_pools
        if pool is not None and not pool.releases_history:
            raise InvalidIds(f"windows.free: pool {pool} keeps its whole history; it is not a sliding-window pool")
        masks = [target.resident(arr) for target in targets]
        counts = [np.count_nonzero(mask) for mask in masks]
        if pool is not None and counts[0] != arr.size:
            raise InvalidIds(f"windows.free: page {arr[np.argmax(~masks[0])]} already left window pool {pool}")
        for target, resident, count in zip(targets, masks, counts, strict=True):
            target.give_cells(target.unbind(arr if count == arr.size else arr[resident]))

    def free_outside_span(self, row_pages: IdsLike, seq_len: int) -> None:
        """Release, in every window pool, the row's pages that lie wholly before the span its
        history rule needs at ``seq_len`` (``PoolId.first_needed``); pages already released
        there are skipped. ``row_pages``: one request's virtual pages in row order (page
        ``k`` holds positions ``[k * page_size, (k + 1) * page_size)``), all live.
        """
        arr = host_ids(row_pages, "free_outside_span")
        ps = self.page_size
        seq_len = count_arg(seq_len, "free_outside_span: seq_len")
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
            if self.holds.total:
                self.holds.refuse_held(pages, "free_outside_span", pool.pool_id)
            if pages.size and self.gates.pinning_gates and self.gates.page_pins[pages].any():
                first = int(pages[np.argmax(self.gates.page_pins[pages] > 0)])
                raise PinnedError(
                    f"free_outside_span: page {first} is pinned by a move gate (in-flight forward or transfer)"
                )
        for pool, pages in releases:
            if pages.size:
                pool.give_cells(pool.unbind(pages))

    def hold(self, pages: IdsLike, pool: PoolId, *, by: object) -> None:
        """The page holder ``by`` keeps the window cells of ``pages`` in ``pool`` (window-cached):
        pages that left their request's window, resident until the holder frees them. They must
        be live, not held whole, resident in ``pool`` and not held there yet."""
        self._pool(pool)
        self.holds.hold(host_ids(pages, "windows.hold"), pool, by)

    def drop_holds(self, pages: IdsLike, pool: PoolId, *, by: object) -> np.ndarray:
        """The holder ``by`` gives up its hold on the window cells of those ``pages`` it holds in
        ``pool`` (the others are skipped; the cells stay resident); returns their mask."""
        return self.holds.drop(host_ids(pages, "windows.drop_holds"), pool, by)

    def held(self, pool: PoolId) -> np.ndarray:
        """Read-only host mask over page ids: whose window cell in ``pool`` the holder keeps."""
        return self.holds.mask(pool)

    def held_count(self, pool: PoolId) -> int:
        """Window cells of ``pool`` held as window-cached (a host counter)."""
        return self.holds.counts[pool]

    def adopt(self, src: IdsLike, dst: IdsLike, pool: PoolId) -> None:
        """Move window residency from pages ``src`` to pages ``dst`` (pairwise), no bytes copied.

        For a prefix cache that keeps ``dst`` (full KV) but lost their window pages, while a
        request just computed the same tokens into ``src``: ``dst`` takes ``src``'s window
        cells, ``src`` becomes tombstoned in that pool.
        """
        s, d = host_ids(src, "windows.adopt src"), host_ids(dst, "windows.adopt dst")
        target = self._pool(pool)
        if not pool.releases_history or s.size != d.size:
            raise InvalidIds(
                f"windows.adopt: need a window pool and equal lengths (pool {pool}, {s.size} src, {d.size} dst)"
            )
        self._check_releasable(s, "windows.adopt src", None, pool)
        self.pages.check_live(d, "windows.adopt dst")
        if not target.resident(s).all() or target.resident(d).any():
            raise InvalidIds(f"windows.adopt: every src page must be resident and every dst page tombstoned in {pool}")
        target.bind(d, target.unbind(s))
