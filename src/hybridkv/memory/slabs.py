"""SlabBroker: decides which pool owns which slab — the floating split between pools.

A pool short of cells gets them, in this order: holes in its own slabs (nothing to do),
free slabs (preferring one next to a slab it owns, so edge cells become usable), then
slabs reclaimed from other pools by compaction: the live cells of a sparse slab move into
holes of their own pool elsewhere, and the emptied slab changes owner. A reclaimed slab is
worth the cells it makes usable (``SubPool.cells_gained``): those inside it and those
straddling into a slab the receiver owns or is given in the same plan, so a pool whose
cells are larger than half a slab (every cell straddles) is served too.

Invariants:
- Decide, then act: a reservation that cannot be met is refused before any byte moves, and
  the slabs it tentatively took are handed back (the pools' ``last_slab`` hints restored),
  so a refused call changes nothing, hints included.
- A reclaim plan never leaves the donor pool short of what the same call needs from it,
  never moves a pinned id, and never moves cells into a slab it is about to empty. The
  plan's arithmetic is exact because only the planned slabs change owner while it runs: a
  moved cell that straddled into a neighbour slab may leave that neighbour without live
  cells, but the neighbour (and the free cells the plan counted there) stays with its pool
  until the reserved cells are taken; then it is settled (spare or released).
- ``cells_moved`` / ``bytes_moved`` count every cell copied.
"""

from __future__ import annotations

import numpy as np

from hybridkv.memory.arena import FREE_SLAB, Arena
from hybridkv.memory.errors import OutOfMemory
from hybridkv.memory.gates import GateRegistry
from hybridkv.memory.pool import SubPool
from hybridkv.spec import IdSpace, PoolId

_EMPTY = np.empty(0, dtype=np.int64)


class SlabBroker:
    def __init__(self, arena: Arena, pools: list[SubPool], gates: GateRegistry):
        assert [p.index for p in pools] == list(range(len(pools)))
        self.arena = arena
        self.pools = pools
        self.gates = gates
        self.cell_bytes = np.array([p.cell_bytes for p in pools], dtype=np.int64)
        self.cells_moved = 0
        self.bytes_moved = 0

    def take(self, needs: dict[SubPool, int]) -> dict[SubPool, np.ndarray]:
        """``needs[pool]`` fresh LIVE cells from every pool, or raise changing nothing."""
        taken, emptied = self._reserve(needs)
        cells = {pool: pool.take_cells(n) for pool, n in needs.items()}
        for pool, slab in taken:  # a slab whose cells stayed in the stack goes back
            if self.arena.owner[slab] == pool.index and self.arena.slab_live[slab] == 0:
                pool.release_slab(slab)
        for pool, slabs in emptied:
            pool.settle(slabs)
        return cells

    def _reserve(self, needs: dict[SubPool, int]) -> tuple[list[tuple[SubPool, int]], list[tuple[SubPool, np.ndarray]]]:
        """Make ``needs[pool]`` FREE cells available. Returns the slabs it acquired, and the
        donors' slabs its moves left empty (kept until ``take`` has taken its cells)."""
        taken: list[tuple[SubPool, int]] = []
        emptied: list[tuple[SubPool, np.ndarray]] = []
        hints = [pool.last_slab for pool in self.pools]
        for pool, need in needs.items():
            while pool.free_count < need:
                slab = self._free_slab_for(pool)
                if slab is None:
                    break
                pool.acquire_slab(slab)
                taken.append((pool, slab))
        deficits = {p: n - p.free_count for p, n in needs.items() if p.free_count < n}
        if not deficits:
            return taken, emptied
        plan = self._plan_reclaim(deficits, needs)
        if plan is None:
            for pool, slab in reversed(taken):
                pool.release_slab(slab)
            for pool, hint in zip(self.pools, hints, strict=True):
                pool.last_slab = hint  # the slabs went back: so does where the next is sought
            short: dict[PoolId | IdSpace, int] = {
                p.pool_id: n - p.free_count for p, n in needs.items() if p.free_count < n
            }
            usage = "; ".join(f"{p.pool_id}: {p.live_count} live/{p.free_count} free cells" for p in self.pools)
            raise OutOfMemory(
                f"short of cells ({', '.join(f'{k} {v}' for k, v in short.items())}): no free "
                f"slab and no movable slab left ({usage}; {self.arena.free_slabs} free slabs)",
                short,
            )
        avoid: dict[SubPool, frozenset[int]] = {}
        for slab, donor, _ in plan:
            avoid[donor] = avoid.get(donor, frozenset()) | {slab}
        for slab, donor, receiver in plan:
            emptied.append((donor, self._empty(donor, slab, avoid[donor])))
            receiver.acquire_slab(slab)
            taken.append((receiver, slab))
        assert all(p.free_count >= n for p, n in needs.items()), "reclaim plan fell short"
        return taken, emptied

    def _free_slab_for(self, pool: SubPool) -> int | None:
        """A free slab beside the pool's last one if possible (so edge cells join), else the
        first free slab from the pool's end of the arena (pools alternate ends)."""
        owner = self.arena.owner
        last = pool.last_slab
        for slab in (last + 1, last - 1):
            if last >= 0 and 0 <= slab < owner.size and owner[slab] == FREE_SLAB:
                return slab
        free = owner == FREE_SLAB
        slab = owner.size - 1 - int(np.argmax(free[::-1])) if pool.index % 2 else int(np.argmax(free))
        return slab if free[slab] else None

    def _plan_reclaim(
        self, deficits: dict[SubPool, int], needs: dict[SubPool, int]
    ) -> list[tuple[int, SubPool, SubPool]] | None:
        """Choose slabs to empty (cheapest bytes first) and who receives each, or None."""
        self.gates.sweep()
        owner, live = self.arena.owner, self.arena.slab_live
        spare = {p: p.free_count - needs.get(p, 0) for p in self.pools}
        room = np.array([spare[p] for p in self.pools], dtype=np.int64)
        candidates = np.flatnonzero(owner != FREE_SLAB)  # spare (empty) slabs cost nothing
        # a donor must have room elsewhere for a slab's live cells: filter before the loop
        candidates = candidates[room[owner[candidates]] >= live[candidates]]
        cost = live[candidates] * self.cell_bytes[owner[candidates]]
        order = [int(j) for j in candidates[np.argsort(cost, kind="stable")]]
        plan: list[tuple[int, SubPool, SubPool]] = []
        used: set[int] = set()
        for receiver, deficit in deficits.items():
            planned: set[int] = set()  # this receiver's slabs so far: cells straddling into them count
            progress = True
            while deficit > 0 and progress:  # again while a slab taken made a neighbour worth taking
                progress = False
                for slab in order:
                    if deficit <= 0:
                        break
                    donor = self.pools[owner[slab]]
                    if slab in used or donor is receiver:
                        continue
                    gained = receiver.cells_gained(slab, planned)
                    if not gained:
                        continue
                    cells = donor.live_cells_touching(slab)
                    lost = cells.size + donor.free_cells_touching(slab)
                    if spare[donor] < lost or self._pinned(donor, cells):
                        continue
                    spare[donor] -= lost
                    used.add(slab)
                    planned.add(slab)
                    plan.append((slab, donor, receiver))
                    deficit -= gained
                    progress = True
            if deficit > 0:
                return None
        return plan

    def _pinned(self, pool: SubPool, cells: np.ndarray) -> bool:
        pins = self.gates.slot_pins if pool.layout.id_space is IdSpace.SLOT else self.gates.page_pins
        return bool(pins[pool.p2v[cells]].any())

    def _empty(self, pool: SubPool, slab: int, avoid: frozenset[int]) -> np.ndarray:
        """Move ``slab``'s live cells out of ``avoid`` and hand the slab to the arena; returns
        the pool's other slabs the moves left without live cells (for ``SubPool.settle``)."""
        cells = pool.live_cells_touching(slab)
        emptied = _EMPTY
        if cells.size:
            emptied = pool.move(cells, avoid)
            self.cells_moved += cells.size
            self.bytes_moved += cells.size * pool.cell_bytes
        pool.release_slab(slab)
        return emptied[emptied != slab]

    def compact(self, max_slabs: int | None = None) -> int:
        """Idle-time defragmentation: empty the sparsest slabs into holes of the same pool.

        Returns how many slabs went back to the free list. Each step frees one slab, so the
        loop ends; pinned cells are never moved.
        """
        self.gates.sweep()
        freed = 0
        for pool in self.pools:
            while max_slabs is None or freed < max_slabs:
                slab = self._sparsest_movable(pool)
                if slab is None:
                    break
                pool.settle(self._empty(pool, slab, frozenset({slab})))
                freed += 1
        return freed

    def _sparsest_movable(self, pool: SubPool) -> int | None:
        slabs = pool.owned_slabs()
        for j in slabs[np.argsort(self.arena.slab_live[slabs], kind="stable")]:
            j = int(j)
            cells = pool.live_cells_touching(j)
            free_elsewhere = pool.free_count - pool.free_cells_touching(j)
            if free_elsewhere >= cells.size and not self._pinned(pool, cells):
                return j
        return None
