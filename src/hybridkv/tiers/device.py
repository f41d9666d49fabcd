"""The device side of the tiers: what the device's tree holds for a prefix, and cell bytes.

``device_view`` walks the prefix cache's tree (read-only: no split, no touch) and says which
pages' full KV the device holds, which window cells are resident and where checkpoints sit,
so the cross-tier rule can prefer the device wherever it has a piece.

``read_cells`` / ``write_cells`` copy whole cells (every layer's bytes of one page of a pool,
or of one state slot) between the memory's arena and frame payloads. A cell is the union of
the pool's per-layer views (``UnifiedMemory.view``), so a byte-exact cell is a byte-exact
tensor in every view. On a meta arena (a replay) nothing is copied.

Invariant: ids are virtual page ids (or state slots) live in the pool; the physical cells
come from the memory's host table at the time of the call.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.cache import HybridRadixCache
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import PoolId
from hybridkv.tiers.framing import HEADER

_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class DeviceView:
    pages: np.ndarray
    """Virtual page ids of the device's full-KV match (every full-history pool holds them)."""
    window_resident: tuple[np.ndarray, ...]
    """Per window pool (rules order): which of ``pages`` have their window cell resident."""
    checkpoints: dict[int, int]
    """Checkpoint slot by end page, on the nodes the match covers whole."""
    names: list[int] | None
    """The cache's names of ``pages`` (``Node.hashes``), or None if its nodes carry none."""


def device_view(cache: HybridRadixCache, tokens: np.ndarray, namespace: Hashable = None) -> DeviceView:
    windows = cache.rules.windows
    root = cache.tree.find_root(namespace)
    if root is None:
        return DeviceView(_EMPTY, tuple(np.zeros(0, dtype=bool) for _ in windows), {}, [])
    walk = cache.tree.walk(root, tokens)
    pages = walk.pages
    resident = tuple(w.pool.resident(pages) for w in windows)
    ps = cache.page_size
    ckpts = {n.end // ps: n.checkpoint for n in walk.nodes if n.checkpoint >= 0}
    names: list[int] | None = None
    if root.hashes is not None:
        names = [h for n in walk.nodes for h in n.hashes or ()]
        if walk.partial is not None and walk.partial.hashes is not None:
            names += walk.partial.hashes[: pages.size - len(names)]
    return DeviceView(pages, resident, ckpts, names)


def _grid(mem: UnifiedMemory, pool: PoolId) -> torch.Tensor:
    sub = mem.pools[pool]
    return sub.arena.cell_grid(sub.grid_cells, sub.cell_bytes)


def read_cells(mem: UnifiedMemory, pool: PoolId, ids: np.ndarray, frames: list[torch.Tensor]) -> None:
    """Copy the cells of ``ids`` into ``frames[i][HEADER:]`` (frames on the host)."""
    if not mem.arena.has_data or not ids.size:
        return
    cells = mem.host_cells(ids, pool)
    if (cells < 0).any():
        raise ValueError(f"read_cells: pool {pool} holds no cell for ids {ids[cells < 0][:5].tolist()}")
    grid = _grid(mem, pool)
    rows = grid.index_select(0, torch.as_tensor(cells, device=grid.device))
    for frame, row in zip(frames, rows, strict=True):
        frame[HEADER:].copy_(row, non_blocking=True)
    if grid.device.type == "cuda":
        torch.cuda.current_stream(grid.device).synchronize()  # the frames are checksummed next


def write_cells(mem: UnifiedMemory, pool: PoolId, ids: np.ndarray, payloads: list[torch.Tensor]) -> None:
    """Copy ``payloads[i]`` (a cell's bytes) into the cell of ``ids[i]``."""
    if not mem.arena.has_data or not ids.size:
        return
    cells = mem.host_cells(ids, pool)
    if (cells < 0).any():
        raise ValueError(f"write_cells: pool {pool} holds no cell for ids {ids[cells < 0][:5].tolist()}")
    grid = _grid(mem, pool)
    rows = torch.stack(payloads).to(grid.device, non_blocking=True)
    grid.index_copy_(0, torch.as_tensor(cells, device=grid.device), rows)


def copy_cells(mem: UnifiedMemory, pool: PoolId, src: np.ndarray, dst: np.ndarray) -> None:
    """Device to device: the cells of ``src`` ids into those of ``dst`` ids."""
    if not src.size:
        return
    sub = mem.pools[pool]
    sub.copy_cells(mem.host_cells(src, pool), mem.host_cells(dst, pool))
