"""StepContext: one step's device-side index tensors, built once from a ForwardBatch.

Every layer of a step reads the same context: the flat new tokens ``T``, their padded
per-request layout ``(R, Q)`` (``Q`` = longest new span), and for each token pool the
physical slots to write the new K/V to and the padded ``(R, L)`` slots to gather each
request's visible context from. Sliding-window pools gather only the positions some new
token can still see (``>= prefix - window + 1``), so tokens that left the window may be
tombstoned.

Invariants:
- Physical ids are produced here, from one ``translate`` per pool and one ``page_cells``
  for the state pool, after every allocation of the step; they are valid for this step
  only (compaction may move cells between steps).
- Padded queries repeat their request's last real position and padded keys point at the
  sink cell with position -1; masks hide padded keys, callers drop padded queries. No host
  read of a device tensor happens here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.engine.batch import ForwardBatch
from hybridkv.memory import UnifiedMemory


@dataclass(frozen=True)
class PoolIndex:
    """Where one token pool's layers write new K/V and which slots each request reads."""

    write_cell: torch.Tensor  # (T,) cell of each new token
    write_offset: torch.Tensor  # (T,) offset inside the cell
    read_cell: torch.Tensor  # (R, L)
    read_offset: torch.Tensor  # (R, L)
    key_valid: torch.Tensor  # (R, L) bool: a real context token, not padding
    visible: torch.Tensor  # (R, 1, Q, L) bool: query q may attend key l


@dataclass(frozen=True)
class StepContext:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    query_index: torch.Tensor  # (R, Q) flat index of each padded query (padding repeats the last)
    flat_from_padded: torch.Tensor  # (T,) index into the (R * Q) padded rows
    extend_lens: torch.Tensor  # (R,)
    last_index: torch.Tensor  # (R,) flat index of each request's last new token
    pools: dict[str, PoolIndex]
    state_cells: torch.Tensor | None  # (R,) state-pool cells
    fresh_state: torch.Tensor | None  # (R,) bool

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Flat ``(T, ...)`` -> padded ``(R, Q, ...)``; padded rows repeat the last real token."""
        return x[self.query_index]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded ``(R, Q, ...)`` -> flat ``(T, ...)``."""
        return x.reshape(-1, *x.shape[2:])[self.flat_from_padded]


def build_step(batch: ForwardBatch, mem: UnifiedMemory, device: torch.device) -> StepContext:
    pre, ext = batch.prefix_lens, batch.extend_lens
    seq = pre + ext
    r, q = ext.size, int(ext.max())
    starts = np.cumsum(ext) - ext
    cols = np.arange(q)
    query_index = starts[:, None] + np.minimum(cols, ext[:, None] - 1)
    query_pos = pre[:, None] + np.minimum(cols, ext[:, None] - 1)
    req = np.repeat(np.arange(r), ext)
    flat_from_padded = req * q + (np.arange(req.size) - starts[req])
    new_locs = np.concatenate([locs[p:] for locs, p in zip(batch.token_locs, pre, strict=True)])

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    ps = mem.page_size
    pools: dict[str, PoolIndex] = {}
    for pool in mem.token_pools:
        window = pool.layout.window
        first = np.zeros(r, dtype=np.int64) if window is None else np.maximum(pre - window + 1, 0)
        width = int((seq - first).max())
        key_pos = first[:, None] + np.arange(width)
        key_valid = key_pos < seq[:, None]
        read_locs = np.concatenate([locs[f:] for locs, f in zip(batch.token_locs, first, strict=True)])
        slots = mem.translate(np.concatenate([new_locs, read_locs]), pool.name)
        grid = torch.zeros(r * width, dtype=torch.int64, device=device)
        grid[dev(np.flatnonzero(key_valid.reshape(-1)))] = slots[new_locs.size :]
        grid = grid.view(r, width)
        kp = np.where(key_valid, key_pos, -1)
        visible = (kp[:, None, :] <= query_pos[:, :, None]) & key_valid[:, None, :]
        if window is not None:
            visible &= kp[:, None, :] > query_pos[:, :, None] - window
        write = slots[: new_locs.size]
        pools[pool.name] = PoolIndex(
            write_cell=torch.div(write, ps, rounding_mode="floor"),
            write_offset=write % ps,
            read_cell=torch.div(grid, ps, rounding_mode="floor"),
            read_offset=grid % ps,
            key_valid=dev(key_valid),
            visible=dev(visible[:, None]),
        )
    state_cells = fresh = None
    if batch.state_slots is not None and batch.fresh_state is not None and mem.state_pool is not None:
        state_cells = mem.page_cells(batch.state_slots, mem.state_pool.name)
        fresh = dev(batch.fresh_state)
    return StepContext(
        input_ids=dev(batch.input_ids),
        positions=dev(batch.positions),
        query_index=dev(query_index),
        flat_from_padded=dev(flat_from_padded),
        extend_lens=dev(ext),
        last_index=dev(starts + ext - 1),
        pools=pools,
        state_cells=state_cells,
        fresh_state=fresh,
    )
