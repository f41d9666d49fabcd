"""An in-process store: a dict of frames with an optional byte capacity (tests; replay sweeps).

It behaves like a shared store that manages its own space: when a put does not fit, it
evicts its least recently used objects *silently* (the caller is not told, exactly like
the Mooncake Store evicting its oldest keys), so a key someone saw with ``exists`` may be
gone when read. A put of a key it holds keeps the first copy (keys name content). Frames
may be meta tensors (sizes, no bytes): a replay's simulated store.

Invariant: ``used_bytes`` is the sum of the held frames' sizes and never exceeds ``capacity``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from hybridkv.tiers.base import PutStatus, StorageTier, TierError
from hybridkv.tiers.framing import MissReason


class DictStore(StorageTier):
    def __init__(self, capacity: int | None = None, name: str = "dict"):
        super().__init__()
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
            raise TierError(f"DictStore capacity must be a byte count >= 0 or None, got {capacity!r}")
        self.name = name
        self.capacity = capacity
        self._objects: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.used_bytes = 0
        self.silent_evictions = 0
        """Objects this store dropped on its own to make room (no caller was told)."""

    def __len__(self) -> int:
        return len(self._objects)

    def _write(self, keys: list[str], frames: list[torch.Tensor], label: str) -> list[PutStatus]:
        out = []
        objects, cap = self._objects, self.capacity
        for key, frame in zip(keys, frames, strict=True):
            if key in objects:
                objects.move_to_end(key)
                out.append(PutStatus.KEPT)
                continue
            size = frame.numel()
            if cap is not None and size > cap:
                out.append(PutStatus.REFUSED)
                continue
            while cap is not None and self.used_bytes + size > cap:
                _, old = objects.popitem(last=False)
                self.used_bytes -= old.numel()
                self.silent_evictions += 1
            objects[key] = frame if frame.device.type == "meta" else frame.clone()
            self.used_bytes += size
            out.append(PutStatus.STORED)
        return out

    def _read(self, keys: list[str], frame_bytes: list[int]) -> list[torch.Tensor | MissReason]:
        out: list[torch.Tensor | MissReason] = []
        objects = self._objects
        for key in keys:
            frame = objects.get(key)
            if frame is None:
                out.append(MissReason.ABSENT)
                continue
            objects.move_to_end(key)
            out.append(frame if frame.device.type == "meta" else frame.clone())
        return out

    def _exists(self, keys: list[str]) -> np.ndarray:
        return np.array(list(map(self._objects.__contains__, keys)), dtype=bool)

    def _remove(self, keys: list[str]) -> int:
        n = 0
        for key in keys:
            frame = self._objects.pop(key, None)
            if frame is not None:
                self.used_bytes -= frame.numel()
                n += 1
        return n
