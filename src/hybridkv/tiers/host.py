"""Host memory below the device: frames in CPU buffers under one byte budget, LRU eviction.

One budget holds every component (full KV pages, window pages, state checkpoints): the split
between them follows what is written and read, byte by byte (``bytes_by_label``), never a
fixed ratio. When a put does not fit, the least recently used objects leave, handed to
``on_evict`` (write-back to the store below) when one is set.

Buffers (``buffer``) are pinned (page-locked) where that helps: only with a CUDA device,
where a pinned buffer copies to and from the device asynchronously at full bandwidth (and
PyTorch's caching host allocator recycles freed pinned blocks). Without one (this project's
CI) pinning has nothing to speed up, so buffers are pageable and ``pin_note`` says so.
``device="meta"`` keeps sizes only (a replay's host tier: no bytes).

Invariants:
- ``used_bytes <= budget`` is the sum of the held frames; ``bytes_by_label`` splits it by
  component.
- ``get`` returns views of the tier's own buffers: valid until the next put to this tier
  (a put may evict and reuse them). Copy them out before putting again.
- An object bigger than the budget is refused; nothing else is ever refused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from hybridkv.memory import parse_bytes
from hybridkv.tiers.base import PutStatus, StorageTier, TierError
from hybridkv.tiers.framing import MissReason, meta_frame
from hybridkv.tiers.lru import LruFrames

EvictSink = Callable[[list[str], list[torch.Tensor], list[str]], None]
"""Told the keys, frames and labels the host evicted (in LRU order); it owns the frames now."""


class HostTier(StorageTier):
    name = "host"

    def __init__(
        self,
        budget: int | str,
        *,
        device: str = "cpu",
        pin: bool | None = None,
        on_evict: EvictSink | None = None,
    ):
        super().__init__()
        self.budget = parse_bytes(budget) if isinstance(budget, str) else budget
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget <= 0:
            raise TierError(f"host memory budget must be a positive byte count (or e.g. '512GiB'), got {budget!r}")
        if device not in ("cpu", "meta"):
            raise TierError(f"host tier device must be 'cpu' or 'meta' (sizes only), got {device!r}")
        self.device = torch.device(device)
        cuda = torch.cuda.is_available()
        if pin is None:
            pin = cuda and device == "cpu"
        if pin and not (cuda and device == "cpu"):
            raise TierError("pin=True needs a CUDA device and a cpu host tier (pinned memory is a CUDA feature)")
        self.pinned = pin
        if device == "meta":
            self.pin_note = "meta host tier: sizes only, no buffers"
        elif pin:
            self.pin_note = "pinned host buffers: asynchronous full-bandwidth copies to and from the device"
        else:
            self.pin_note = (
                "pageable host buffers: no CUDA device here, and pinning only speeds host<->device copies"
                if not cuda
                else "pageable host buffers (pin=False)"
            )
        self.on_evict = on_evict
        self._frames = LruFrames()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def used_bytes(self) -> int:
        return self._frames.used_bytes

    @property
    def bytes_by_label(self) -> Counter[str]:
        return self._frames.bytes_by_label

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A frame buffer of ``nbytes`` for a coming put (pinned when the tier pins); not
        counted until it is put."""
        if self.device.type == "meta":
            return meta_frame(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def touch(self, keys: list[str]) -> None:
        """Mark held ``keys`` most recently used (a planned load: keep them)."""
        for key in keys:
            self._frames.touch(key)

    def clear(self) -> int:
        """Evict every object, least recently used first, exactly as an eviction for room does
        (handed to ``on_evict``: written back to the store below); how many left."""
        gone: tuple[list[str], list[torch.Tensor], list[str]] = ([], [], [])
        self._make_room(self.budget, gone)  # room for a whole budget: every object leaves
        if gone[0] and self.on_evict is not None:
            self.on_evict(*gone)
        return len(gone[0])

    # --- the backend ----------------------------------------------------------------------

    def _write(self, keys: list[str], frames: list[torch.Tensor], label: str) -> list[PutStatus]:
        meta = self.device.type == "meta"
        if any(f.is_meta != meta for f in frames):
            raise TierError(f"host tier on {self.device} got a frame on another device")
        out = []
        held, budget = self._frames, self.budget
        gone: tuple[list[str], list[torch.Tensor], list[str]] = ([], [], [])
        for key, frame in zip(keys, frames, strict=True):
            if held.touch(key):
                out.append(PutStatus.KEPT)
                continue
            size = frame.numel()
            if size > budget:
                out.append(PutStatus.REFUSED)
                continue
            if held.used_bytes + size > budget:
                self._make_room(size, gone)
            held.add(key, frame, label)
            out.append(PutStatus.STORED)
        if gone[0] and self.on_evict is not None:
            self.on_evict(*gone)
        return out

    def _make_room(self, size: int, gone: tuple[list[str], list[torch.Tensor], list[str]]) -> None:
        while self._frames.used_bytes + size > self.budget:
            key, old, label = self._frames.pop_oldest()
            self.evictions += 1
            gone[0].append(key)
            gone[1].append(old)
            gone[2].append(label)

    def _read(self, keys: list[str], frame_bytes: list[int]) -> list[torch.Tensor | MissReason]:
        return self._frames.read(keys)

    def _exists(self, keys: list[str]) -> np.ndarray:
        return self._frames.holds(keys)

    def _remove(self, keys: list[str]) -> int:
        return self._frames.remove(keys)

    def usage(self) -> dict[str, object]:
        return {
            "budget_bytes": self.budget,
            "used_bytes": self.used_bytes,
            "bytes_by_component": {k: v for k, v in self.bytes_by_label.items() if v},
            "objects": len(self._frames),
            "evictions": self.evictions,
            "pinned": self.pinned,
            "pin_note": self.pin_note,
        }
