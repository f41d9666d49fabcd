"""Arena: one byte buffer per device (the whole budget), handed out in slabs.

Layout of the buffer::

    [ sink | slab 0 | slab 1 | ... | slab n-1 | tail ]

- The *sink* holds cell 0 of every sub-pool (the padding page / dummy state slot that
  kernels may write into); no real cell ever overlaps it.
- Each *slab* is owned by at most one sub-pool at a time (``owner[j]``, -1 when free). A
  sub-pool may only use grid cells whose bytes lie entirely inside slabs it owns, so two
  sub-pools never share a byte, and the split between sub-pools floats slab by slab.
- ``slab_live[j]`` counts live cells touching slab ``j``; a slab returns to the free list
  only at zero, so releasing a slab never drops data.
- The *tail* is what is left after the last whole slab; it is never used.

An arena that makes its own buffer zeroes it at once, so every page of the budget is touched at creation and no step
faults one in on first use (on the CPU a fresh page costs a kernel fault and zeroing inside whatever kernel writes
it first: the prefix cache keeps taking fresh pages and state cells until the budget is full). Widened models, 64 x
144-token prompts, one thread, 1 GiB: Qwen3-Next bf16 1.36 -> 1.22 s, Gemma 3 bf16 0.82 -> 0.78 s a round; 0.38 s
a GiB at creation, and the process's resident memory is the whole budget from the start (as a GPU's would be).

A caller may pass its own ``buffer`` (e.g. shared memory another process maps, or memory
registered with a transfer engine). ``device="meta"`` gives an arena without data bytes:
every table is real (on the CPU), every byte copy is skipped, so capacity planning can
replay traffic for any model on a laptop.
"""

from __future__ import annotations

import numpy as np
import torch

FREE_SLAB = -1


class Arena:
    def __init__(
        self,
        nbytes: int,
        sink_bytes: int,
        slab_bytes: int,
        device: str | torch.device,
        buffer: torch.Tensor | None = None,
    ):
        if slab_bytes <= 0 or sink_bytes < 0:
            raise ValueError(f"slab_bytes must be > 0 and sink_bytes >= 0 (got {slab_bytes}, {sink_bytes})")
        if nbytes < sink_bytes + slab_bytes:
            raise ValueError(
                f"arena of {nbytes} B cannot hold the sink ({sink_bytes} B) and one slab "
                f"({slab_bytes} B); raise the memory budget"
            )
        self.device = torch.device(device)
        self.nbytes = nbytes
        self.sink_bytes = sink_bytes
        self.slab_bytes = slab_bytes
        self.num_slabs = (nbytes - sink_bytes) // slab_bytes
        self.tail_bytes = nbytes - sink_bytes - self.num_slabs * slab_bytes
        self.owner = np.full(self.num_slabs, FREE_SLAB, dtype=np.int64)
        self.slab_live = np.zeros(self.num_slabs, dtype=np.int64)
        if buffer is None:  # zeroed: every page of the budget touched once, now (the module docstring)
            buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        elif buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < nbytes:
            raise ValueError(
                f"arena buffer must be a 1-D uint8 tensor of at least {nbytes} B, got "
                f"{buffer.dtype} shape {tuple(buffer.shape)}"
            )
        elif buffer.device != self.device:
            raise ValueError(f"arena buffer is on {buffer.device}, arena device is {self.device}")
        self.buffer = buffer[:nbytes]

    @property
    def has_data(self) -> bool:
        return self.device.type != "meta"

    @property
    def table_device(self) -> torch.device:
        """Where page tables live: the arena's device, or the CPU for a meta arena."""
        return torch.device("cpu") if self.device.type == "meta" else self.device

    @property
    def free_slabs(self) -> int:
        return int(np.count_nonzero(self.owner == FREE_SLAB))

    def strided_view(
        self, dtype: torch.dtype, cells: int, cell_bytes: int, offset: int, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """``cells`` copies of a ``shape`` tensor, one every ``cell_bytes``, from ``offset``."""
        size = dtype.itemsize
        if cell_bytes % size or offset % size:
            raise ValueError(
                f"view of {dtype} needs cell stride {cell_bytes} and offset {offset} to be multiples of {size}"
            )
        typed = self.buffer[: self.nbytes - self.nbytes % size].view(dtype)
        inner = []
        step = 1
        for dim in reversed(shape):
            inner.append(step)
            step *= dim
        strides = (cell_bytes // size, *reversed(inner))
        # as_strided's offset counts from the storage's start: a caller's buffer may start inside it (shm header)
        return typed.as_strided((cells, *shape), strides, typed.storage_offset() + offset // size)

    def cell_grid(self, cells: int, cell_bytes: int) -> torch.Tensor:
        """The arena as ``cells`` rows of ``cell_bytes`` bytes (uint8), for whole-cell copies."""
        return self.buffer[: cells * cell_bytes].view(cells, cell_bytes)
