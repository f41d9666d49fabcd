"""StepContext: one step's device-side index tensors, built once from a ForwardBatch.

Every layer of a step reads the same context: the flat new tokens ``T``, their padded
per-request layout ``(R, Q)`` (``Q`` = longest new span), and for each token pool the
physical slots to write the new K/V to (``writes``) and the padded ``(R, L)`` slots to
gather each request's visible context from. Pools that release history (sliding windows) gather only
the positions some new token can still see (``>= first_needed(prefix + 1)``, the pool id's
rule), so tokens that left the window may be tombstoned. ``groups`` lays the same requests
out again in two padded groups, the one-token decodes and the longer spans, so that
attention does not pad a decode's one query to the longest prefill chunk of the step (one
group when the step has one kind).

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
from hybridkv.spec import RECURRENT_POOL, PoolId


@dataclass(frozen=True)
class WriteSlots:
    """Where one token pool's layers write the step's new K/V: a cell and an offset per new token."""

    cell: torch.Tensor  # (T,)
    offset: torch.Tensor  # (T,)


@dataclass(frozen=True)
class PoolIndex:
    """Which slots each request of a padded group reads from one token pool."""

    read_cell: torch.Tensor  # (R, L)
    read_offset: torch.Tensor  # (R, L)
    key_valid: torch.Tensor  # (R, L) bool: a real context token, not padding
    visible: torch.Tensor  # (R, 1, Q, L) bool: query q may attend key l


@dataclass(frozen=True)
class Padded:
    """Some of the step's requests as a padded ``(R', Q')`` batch of queries and ``(R', L)`` of keys."""

    rows: torch.Tensor  # (R',) which of the step's requests, in order
    lengths: torch.Tensor  # (R',) their new-token counts
    query_index: torch.Tensor  # (R', Q') flat index of each padded query (padding repeats the last)
    flat_index: torch.Tensor  # (T',) the flat tokens of these requests, in order
    from_padded: torch.Tensor  # (T',) their rows in the (R' * Q') padded layout
    pools: dict[PoolId, PoolIndex]

    @property
    def decode_only(self) -> bool:
        """Every request of the group adds one token (a host fact: the padded width)."""
        return self.query_index.shape[1] == 1

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Flat ``(T, ...)`` -> padded ``(R', Q', ...)``; padded rows repeat the last real token."""
        return x[self.query_index]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded ``(R', Q', ...)`` -> ``(T', ...)``, the rows of ``flat_index``."""
        return x.reshape(-1, *x.shape[2:])[self.from_padded]


@dataclass(frozen=True)
class StepContext:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    last_index: torch.Tensor  # (R,) flat index of each request's last new token
    writes: dict[PoolId, WriteSlots]  # per token pool, where the new K/V go
    groups: tuple[Padded, ...]  # decodes and longer spans apart (or the one group)
    state_cells: torch.Tensor | None  # (R,) state-pool cells
    fresh_state: torch.Tensor | None  # (R,) bool


@dataclass(frozen=True)
class _PoolSlots:
    """One pool's translated slots: new tokens (T,), and every request's visible context, flat."""

    pool_id: PoolId
    write: torch.Tensor
    read: torch.Tensor
    first: np.ndarray  # (R,) first visible position of each request
    read_start: np.ndarray  # (R,) where each request's visible context starts in ``read``


def build_step(batch: ForwardBatch, mem: UnifiedMemory, device: torch.device) -> StepContext:
    pre, ext = batch.prefix_lens, batch.extend_lens
    seq = pre + ext
    starts = np.cumsum(ext) - ext
    new_locs = np.concatenate([locs[p:] for locs, p in zip(batch.token_locs, pre, strict=True)])

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    slots: dict[PoolId, _PoolSlots] = {}
    for pool in mem.token_pools:
        rule = pool.pool_id
        first = rule.first_needed(pre + 1)  # what the step's first query sees
        read_locs = np.concatenate([locs[f:] for locs, f in zip(batch.token_locs, first, strict=True)])
        translated = mem.translate(np.concatenate([new_locs, read_locs]), rule)
        lengths = seq - first
        slots[rule] = _PoolSlots(
            rule, translated[: new_locs.size], translated[new_locs.size :], first, np.cumsum(lengths) - lengths
        )

    ps = mem.page_size

    def layout(rows: np.ndarray) -> Padded:
        e, p, s, st = ext[rows], pre[rows], seq[rows], starts[rows]
        r, q = rows.size, int(e.max())
        cols = np.minimum(np.arange(q), e[:, None] - 1)
        query_pos = p[:, None] + cols
        flat = np.concatenate([np.arange(a, a + n) for a, n in zip(st, e, strict=True)])
        local = np.repeat(np.arange(r), e)
        from_padded = local * q + (np.arange(local.size) - (np.cumsum(e) - e)[local])
        pools: dict[PoolId, PoolIndex] = {}
        for pool_id, sl in slots.items():
            first = sl.first[rows]
            width = int((s - first).max())
            key_pos = first[:, None] + np.arange(width)
            key_valid = key_pos < s[:, None]
            src = (sl.read_start[rows][:, None] + np.arange(width))[key_valid]
            grid = torch.zeros(r * width, dtype=torch.int64, device=device)
            grid[dev(np.flatnonzero(key_valid.reshape(-1)))] = sl.read[dev(src)]
            grid = grid.view(r, width)
            kp = np.where(key_valid, key_pos, -1)
            visible = (kp[:, None, :] <= query_pos[:, :, None]) & key_valid[:, None, :]
            if sl.pool_id.releases_history:
                visible &= kp[:, None, :] >= sl.pool_id.first_needed(query_pos + 1)[:, :, None]
            pools[pool_id] = PoolIndex(
                read_cell=torch.div(grid, ps, rounding_mode="floor"),
                read_offset=grid % ps,
                key_valid=dev(key_valid),
                visible=dev(visible[:, None]),
            )
        return Padded(dev(rows), dev(e), dev(st[:, None] + cols), dev(flat), dev(from_padded), pools)

    decodes = ext == 1
    groups: tuple[Padded, ...] = (layout(np.arange(ext.size)),)
    if decodes.any() and not decodes.all():
        groups = (layout(np.flatnonzero(decodes)), layout(np.flatnonzero(~decodes)))
    writes = {
        pool_id: WriteSlots(torch.div(sl.write, ps, rounding_mode="floor"), sl.write % ps)
        for pool_id, sl in slots.items()
    }
    state_cells = fresh = None
    if batch.state_slots is not None and batch.fresh_state is not None and mem.slot_pools:
        state_cells = mem.page_cells(batch.state_slots, RECURRENT_POOL)
        fresh = dev(batch.fresh_state)
    return StepContext(
        input_ids=dev(batch.input_ids),
        positions=dev(batch.positions),
        last_index=dev(starts + ext - 1),
        writes=writes,
        groups=groups,
        state_cells=state_cells,
        fresh_state=fresh,
    )
