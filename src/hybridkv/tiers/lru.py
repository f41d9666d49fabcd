"""LruFrames: a tier's frames by key, least recently used first, with their byte counts.

Shared by the host tier and the in-process dict store: both keep the first copy of a key (keys
name content), move a key to the most recent end when it is read or written again, and evict
from the least recent end.

Invariants: ``used_bytes`` is the sum of the held frames' sizes; ``bytes_by_label[l]`` the sum
of those put with label ``l``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np
import torch

from hybridkv.tiers.framing import MissReason


class LruFrames:
    def __init__(self) -> None:
        self._frames: OrderedDict[str, tuple[torch.Tensor, str]] = OrderedDict()
        self.used_bytes = 0
        self.bytes_by_label: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._frames)

    def touch(self, key: str) -> bool:
        """Mark ``key`` most recently used; whether it is held."""
        if key not in self._frames:
            return False
        self._frames.move_to_end(key)
        return True

    def add(self, key: str, frame: torch.Tensor, label: str) -> None:
        """Hold ``frame`` (not held yet) as the most recently used."""
        self._frames[key] = (frame, label)
        self.used_bytes += frame.numel()
        self.bytes_by_label[label] += frame.numel()

    def pop_oldest(self) -> tuple[str, torch.Tensor, str]:
        key, (frame, label) = self._frames.popitem(last=False)
        self._forget(frame, label)
        return key, frame, label

    def read(self, keys: list[str]) -> list[torch.Tensor | MissReason]:
        """Each key's frame (marked most recently used), or ``ABSENT``."""
        out: list[torch.Tensor | MissReason] = []
        for key in keys:
            out.append(self._frames[key][0] if self.touch(key) else MissReason.ABSENT)
        return out

    def holds(self, keys: list[str]) -> np.ndarray:
        return np.array(list(map(self._frames.__contains__, keys)), dtype=bool)

    def remove(self, keys: list[str]) -> int:
        """Drop the held ``keys``; how many were held."""
        n = 0
        for key in keys:
            held = self._frames.pop(key, None)
            if held is not None:
                self._forget(*held)
                n += 1
        return n

    def _forget(self, frame: torch.Tensor, label: str) -> None:
        self.used_bytes -= frame.numel()
        self.bytes_by_label[label] -= frame.numel()
