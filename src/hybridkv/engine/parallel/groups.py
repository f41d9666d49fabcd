"""StageGroups: the ``torch.distributed`` groups of one ``Parallel`` layout, seen from one process.

A layout of ``P`` stages x ``T`` TP ranks runs on ``P * T`` processes of a world, listed as
world ranks in (stage, TP rank) order: layout rank ``pp_rank * T + tp_rank``.

Invariants:
- The backend follows the device (``nccl`` for CUDA tensors, ``gloo`` otherwise); the world
  is initialised over TCP on 127.0.0.1 with a timeout, and every group is created with one:
  every collective and point-to-point op of the layout raises after it instead of hanging.
- ``StageGroups.create`` is collective over the whole world: every process calls it for
  every layout, in the same order (a non-member gets ``None`` back), so group creation
  never depends on which processes a layout uses.
- TP rank ``t`` of stage ``s`` sends its hidden states to TP rank ``t`` of stage ``s + 1``
  (a stage's TP ranks hold identical hidden states after every block's reduce).
- The last stage's TP rank 0 broadcasts its logits to every rank of the layout, so every
  rank samples the same tokens and runs the same schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridkv.spec import Parallel

DEFAULT_TIMEOUT_S = 60.0


def backend_for(device: str | torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_world(
    rank: int, world_size: int, port: int, device: str | torch.device, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Join the world of ``world_size`` processes at ``tcp://127.0.0.1:port`` (backend from ``device``).

    On CUDA, rank ``r`` uses GPU ``r % device_count`` (set before the NCCL group exists)."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend_for(device),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


@dataclass
class StageGroups:
    """This process's place in a layout: its stage, its TP rank, and the groups and peers it talks to."""

    parallel: Parallel
    ranks: tuple[int, ...]  # world ranks in (stage, tp) order
    pp_rank: int
    tp_rank: int
    tp_group: Any  # ProcessGroup of this stage's TP ranks
    layout_group: Any  # ProcessGroup of every rank of the layout

    @classmethod
    def create(
        cls, parallel: Parallel, ranks: Sequence[int], timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> StageGroups | None:
        """Create the layout's groups (collective over the world); ``None`` where this process is not in ``ranks``."""
        size = parallel.pp_size * parallel.tp_size
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) != size or len(set(ranks)) != size:
            raise ValueError(
                f"a layout of PP {parallel.pp_size} x TP {parallel.tp_size} needs {size} distinct world ranks, "
                f"got {list(ranks)}"
            )
        world = dist.get_world_size()
        if max(ranks) >= world or min(ranks) < 0:
            raise ValueError(f"ranks {list(ranks)} outside the world of {world} processes")
        timeout = timedelta(seconds=timeout_s)
        tp = parallel.tp_size
        stage_groups = [
            dist.new_group(list(ranks[s * tp : (s + 1) * tp]), timeout=timeout) for s in range(parallel.pp_size)
        ]
        layout_group = dist.new_group(list(ranks), timeout=timeout)
        me = dist.get_rank()
        if me not in ranks:
            return None
        index = ranks.index(me)
        pp_rank, tp_rank = divmod(index, tp)
        return cls(parallel, ranks, pp_rank, tp_rank, stage_groups[pp_rank], layout_group)

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.parallel.pp_size - 1

    def _world_rank(self, pp_rank: int, tp_rank: int) -> int:
        return self.ranks[pp_rank * self.parallel.tp_size + tp_rank]

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of the stage's TP ranks' ``partial`` (in place)."""
        dist.all_reduce(partial, group=self.tp_group)
        return partial

    def send_next(self, hidden: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), dst=self._world_rank(self.pp_rank + 1, self.tp_rank))

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=self._world_rank(self.pp_rank - 1, self.tp_rank))
        return out

    def broadcast_from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's TP rank 0 ``tensor`` on every rank of the layout (in place)."""
        dist.broadcast(tensor, src=self._world_rank(self.parallel.pp_size - 1, 0), group=self.layout_group)
        return tensor
