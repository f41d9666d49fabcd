"""MirroredTable: a host int64 table (authoritative) with a device copy kept in step lazily.

Hot-path writes touch only the host array and remember which entries changed. Reading
``device`` first applies the pending entries with one ``index_copy_`` from host memory
(pinned and non-blocking on a GPU), so the host never waits for the device and never reads
it. Engines read ``device`` once per step (before a forward), which batches a step's
updates into one copy. When the device is the CPU, the "device copy" is the host array
itself (a zero-copy tensor view), so there is nothing to mirror.

Invariants: after ``flush()``, ``device`` equals ``host`` element for element; the pending
list never holds more than a quarter of the table (beyond that one whole copy is cheaper,
and the list is dropped), so a table that is rarely read does not grow without bound.
"""

from __future__ import annotations

import numpy as np
import torch


def to_index(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host int array -> int64 tensor on ``device``, without a blocking copy."""
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class MirroredTable:
    def __init__(self, size: int, device: torch.device, fill: int = -1, share_cpu: bool = True):
        self.host = np.full(size, fill, dtype=np.int64)
        self._shared = share_cpu and device.type == "cpu"
        self._device = torch.from_numpy(self.host) if self._shared else to_index(self.host, device).clone()
        self._dirty: list[np.ndarray] = []
        self._dirty_entries = 0
        self._whole = False

    def __len__(self) -> int:
        return self.host.size

    def set(self, index: np.ndarray, values: np.ndarray | int) -> None:
        self.host[index] = values
        if self._shared or self._whole:
            return
        self._dirty.append(np.asarray(index, dtype=np.int64).reshape(-1))
        self._dirty_entries += self._dirty[-1].size
        if self._dirty_entries * 4 >= self.host.size:
            self._whole = True
            self._dirty.clear()

    def flush(self) -> None:
        dev = self._device.device
        if self._whole:
            self._device.copy_(to_index(self.host, dev), non_blocking=True)
        elif self._dirty:  # repeated indices carry equal values (the host's): no dedup needed
            index = np.concatenate(self._dirty) if len(self._dirty) > 1 else self._dirty[0]
            self._device.index_copy_(0, to_index(index, dev), to_index(self.host[index], dev))
        self._dirty.clear()
        self._dirty_entries = 0
        self._whole = False

    @property
    def device(self) -> torch.Tensor:
        """The device copy, brought up to date first (no host read of device memory)."""
        self.flush()
        return self._device
