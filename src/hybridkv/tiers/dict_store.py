"""An in-process store: a dict of frames with an optional byte capacity (tests; replay sweeps).

It behaves like a shared store that manages its own space: when a put does not fit, it
evicts its least recently used objects *silently* (the caller is not told, exactly like
the Mooncake Store evicting its oldest keys), so a key someone saw with ``exists`` may be
gone when read. A put of a key it holds keeps the first copy (keys name content). Frames
may be meta tensors (sizes, no bytes): a replay's simulated store.

Invariant: ``used_bytes`` is the sum of the held frames' sizes and never exceeds ``capacity``.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.tiers.base import PutStatus, StorageTier, TierError
from hybridkv.tiers.framing import MissReason
from hybridkv.tiers.lru import LruFrames


class DictStore(StorageTier):
    def __init__(self, capacity: int | None = None, name: str = "dict"):
        super().__init__()
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
            raise TierError(f"DictStore capacity must be a byte count >= 0 or None, got {capacity!r}")
        self.name = name
        self.capacity = capacity
        self._frames = LruFrames()
        self.silent_evictions = 0
        """Objects this store dropped on its own to make room (no caller was told)."""

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def used_bytes(self) -> int:
        return self._frames.used_bytes

    def _write(self, keys: list[str], frames: list[torch.Tensor], label: str) -> list[PutStatus]:
        out = []
        held, cap = self._frames, self.capacity
        for key, frame in zip(keys, frames, strict=True):
            if held.touch(key):
                out.append(PutStatus.KEPT)
                continue
            size = frame.numel()
            if cap is not None and size > cap:
                out.append(PutStatus.REFUSED)
                continue
            while cap is not None and held.used_bytes + size > cap:
                held.pop_oldest()
                self.silent_evictions += 1
            held.add(key, frame if frame.device.type == "meta" else frame.clone(), label)
            out.append(PutStatus.STORED)
        return out

    def _read(self, keys: list[str], frame_bytes: list[int]) -> list[torch.Tensor | MissReason]:
        return [
            f if isinstance(f, MissReason) or f.device.type == "meta" else f.clone() for f in self._frames.read(keys)
        ]

    def _exists(self, keys: list[str]) -> np.ndarray:
        return self._frames.holds(keys)

    def _remove(self, keys: list[str]) -> int:
        return self._frames.remove(keys)
