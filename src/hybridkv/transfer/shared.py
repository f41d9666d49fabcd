"""Shared-memory arenas: a decode memory whose bytes other processes on the host can map.

The arena buffer is a file in ``/dev/shm`` mapped ``MAP_SHARED`` (``torch.from_file``) and
handed to ``UnifiedMemory`` through its ``buffer`` argument; a writer maps the same file
and sees the same bytes.

Invariants:
- The file has exactly the arena's size and a unique name; it is unlinked when the owner
  closes it (or is garbage collected). A peer that mapped it keeps a valid mapping until
  it unmaps it, so a decode shutdown never faults a writer.
"""

from __future__ import annotations

import contextlib
import os
import uuid
import weakref

import torch

from hybridkv.memory import MemoryHints, UnifiedMemory, parse_bytes, plan_memory
from hybridkv.spec import ShardSpec

SHM_DIR = "/dev/shm"


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedBuffer:
    """A ``/dev/shm`` file of ``nbytes`` bytes, mapped as one uint8 tensor."""

    def __init__(self, nbytes: int, prefix: str = "hybridkv") -> None:
        if nbytes <= 0:
            raise ValueError(f"shared buffer needs a positive size, got {nbytes}")
        self.nbytes = nbytes
        self.path = os.path.join(SHM_DIR, f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        self.tensor = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()

    def close(self) -> None:
        """Unlink the file; this process's mapping lives until the tensor is dropped."""
        self._finalizer()


def shared_memory(shard: ShardSpec, budget: int | str, **hints: object) -> tuple[UnifiedMemory, SharedBuffer]:
    """A CPU ``UnifiedMemory`` whose arena lives in a ``SharedBuffer``."""
    plan = plan_memory(shard, parse_bytes(budget), MemoryHints(**hints))  # type: ignore[arg-type]
    shared = SharedBuffer(plan.budget_bytes)
    return UnifiedMemory(plan, "cpu", buffer=shared.tensor), shared
