"""Agreement: how the ranks of one engine make the same scheduling decision over different memories.

Every rank of an engine (PP stages x TP ranks) runs the same ``Scheduler`` over its own
memory. Stages hold different layers, so a prefix hit, an admission or a step's allocation may
succeed on one rank and not on another; the scheduler asks its ``Agreement`` at each such
decision and every rank then acts on the agreed value:

- ``min(values)``: the element-wise minimum over the ranks (hit lengths, negated for the
  maximum; success flags, where 0 on any rank means no).

``ALONE`` (one process, or ranks whose memories are replicas: decode TP ranks) returns its
input. ``WorldAgreement`` runs one collective per call over a ``torch.distributed`` group, with
the group's timeout: a rank that never arrives fails the call instead of hanging it.

Invariant: every rank of the group makes the same sequence of calls (the scheduler's decisions
are a function of agreed values and of the command stream every rank sees alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Agreement(Protocol):
    def min(self, values: Sequence[int]) -> list[int]: ...


class _Alone:
    def min(self, values: Sequence[int]) -> list[int]:
        return [int(v) for v in values]


ALONE: Agreement = _Alone()


class WorldAgreement:
    """Agreement over every rank of ``group`` (a ``torch.distributed`` process group)."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size

    def min(self, values: Sequence[int]) -> list[int]:
        if not values:
            return []
        t = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]
