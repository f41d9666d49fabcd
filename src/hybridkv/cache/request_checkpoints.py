"""Checkpoints: a request's state checkpoints, the part of ``KVManager`` that places them (``kvm.checkpoints``).

A checkpoint is a state slot holding the recurrent state after a page-aligned number of a
request's tokens, kept in ``KVHandle.checkpoints`` until an insert reaching its position
hands it to the cache. Three ways to fill one: a copy of the running state now
(``take``), a slot reserved for a copy the computation writes when it passes the
position (``reserve`` / ``reserve_each``; a step's chunks at once: ``reserve_step``),
or the running state itself when the request computes no more (``take_final``). The
placement (``wanted``, ``at_finish``) says where they are wanted. Its dependencies are
handed to it: the memory (for messages), the page size, the placement, the state pool (None
without recurrent layers) and the manager's evicting ``alloc_state`` / ``fork_state``.

Invariants: a checkpoint sits at a multiple of the page size past the handle's cached part,
one per position; a refused call (``CacheError``) reserves nothing; a reservation refused
for memory (``OutOfMemory``, after eviction) reserves none of its positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hybridkv.cache.args import integer
from hybridkv.cache.errors import CacheError
from hybridkv.cache.handle import KVHandle, checked_handle, checked_handles
from hybridkv.cache.placement import CheckpointPlacement
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import PoolId


class Checkpoints:
    def __init__(
        self,
        mem: UnifiedMemory,
        placement: CheckpointPlacement,
        state_pool: PoolId | None,
        alloc_state: Callable[[int], np.ndarray],
        fork_state: Callable[[list[int]], np.ndarray],
    ):
        """``alloc_state`` / ``fork_state``: the manager's, which evict for what they are short of."""
        self.mem = mem
        self.page_size = placement.page_size
        self.placement = placement
        self.state_pool = state_pool
        self._alloc_state = alloc_state
        self._fork_state = fork_state

    def take(self, handle: KVHandle) -> int:
        """Copy the running state now (after ``seq_len`` tokens, page-aligned) into a new
        checkpoint slot; the next insert caches it."""
        handle, at, running = _running_state(self, handle, "checkpoints.take")
        slot = int(self._fork_state([running])[0])
        handle.checkpoints[at] = slot
        return slot

    def take_final(self, handle: KVHandle) -> int:
        """The running state (after ``seq_len`` tokens, page-aligned) becomes the checkpoint there, without a copy:
        the request computes no more (its final insert, ``finish``, caches it); it holds no running slot after."""
        handle, at, slot = _running_state(self, handle, "checkpoints.take_final")
        handle.state_slot = None
        handle.checkpoints[at] = slot
        return slot

    def reserve(self, handle: KVHandle, at: int) -> int:
        """A fresh slot for the state after ``at`` tokens (page-aligned): the caller copies the
        state into it when its computation passes ``at``; the next insert reaching ``at``
        caches it."""
        return int(self._reserve([(checked_handle(handle, "checkpoints.reserve"), at)], "checkpoints.reserve")[0])

    def reserve_each(self, handle: KVHandle, positions: Sequence[int]) -> list[int]:
        """``reserve`` at each of ``positions`` (distinct), with one allocation: on
        ``OutOfMemory`` (after eviction) none is reserved."""
        handle = checked_handle(handle, "checkpoints.reserve_each")
        return self._reserve([(handle, at) for at in positions], "checkpoints.reserve_each").tolist()

    def reserve_step(self, handles: Sequence[KVHandle], positions: Sequence[int]) -> np.ndarray:
        """``reserve`` of ``handles[i]`` at ``positions[i]``, with one allocation for all (a step whose
        chunks end where the placement wants checkpoints: its forward writes them). On ``OutOfMemory`` (after
        eviction) none is reserved."""
        handles = checked_handles(handles, "checkpoints.reserve_step")
        if not isinstance(positions, Sequence) or len(positions) != len(handles):
            raise CacheError(
                f"checkpoints.reserve_step: need one position per handle ({len(handles)}), got {positions!r}"
            )
        return self._reserve(list(zip(handles, positions, strict=True)), "checkpoints.reserve_step")

    def _reserve(self, pairs: list[tuple[KVHandle, int]], name: str) -> np.ndarray:
        """Slots for ``(handle, position)`` pairs (distinct), one allocation: all reserved or none."""
        checked = [(h, integer(at, f"{name} at")) for h, at in pairs]
        if len({(id(h), at) for h, at in checked}) != len(checked):
            raise CacheError(f"{name}: positions {[at for _, at in checked]} repeat one for a request")
        for h, at in checked:
            h.check_running(name)
            self._check_checkpoint(h, at)
        if not checked:
            return np.empty(0, dtype=np.int64)
        slots = self._alloc_state(len(checked))
        for (h, at), slot in zip(checked, slots.tolist(), strict=True):
            h.checkpoints[at] = slot
        return slots

    def wanted(self, handle: KVHandle, prompt_len: int) -> tuple[int, ...]:
        """Page-aligned positions past the handle's computed tokens (``seq_len``) and up to
        ``prompt_len`` where the placement wants the state stored: prefill ends a chunk at each
        (``reserve`` / ``take`` there). Empty without recurrent layers."""
        handle = checked_handle(handle, "checkpoints.wanted")
        prompt_len = integer(prompt_len, "checkpoints.wanted prompt_len")
        if self.state_pool is None:
            return ()
        return self.placement.prefill(handle.match.checkpoint_at, prompt_len, handle.seq_len)

    def at_finish(self, handle: KVHandle) -> int | None:
        """Where the placement wants the state stored when the request finishes at its
        ``seq_len`` (page-aligned, past the cached part, not taken yet), or None."""
        handle = checked_handle(handle, "checkpoints.at_finish")
        if self.state_pool is None:
            return None
        at = self.placement.at_finish(handle.seq_len, handle.cached * self.page_size)
        return None if at is None or at in handle.checkpoints else at

    def _check_checkpoint(self, handle: KVHandle, at: int) -> None:
        if self.state_pool is None:
            raise CacheError(f"checkpoint: this shard ({self.mem.shard.describe()}) has no recurrent layers")
        cached = handle.cached * self.page_size
        if at % self.page_size or at <= cached or at in handle.checkpoints:
            raise CacheError(
                f"checkpoint at {at}: must be a multiple of the page size {self.page_size} past the "
                f"cached {cached} tokens, and not taken already (taken: {sorted(handle.checkpoints)})"
            )


def _running_state(manager: Checkpoints, handle: KVHandle, name: str) -> tuple[KVHandle, int, int]:
    """``handle`` checked for a checkpoint of its running state now: ``(handle, seq_len, its running slot)``."""
    handle = checked_handle(handle, name)
    handle.check_running(name)
    at = handle.seq_len
    manager._check_checkpoint(handle, at)
    if handle.state_slot is None:
        raise CacheError(f"{name}: the request has no running state slot")
    return handle, at, handle.state_slot
