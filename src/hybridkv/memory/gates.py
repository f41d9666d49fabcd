"""Move gates: pins that keep pages and state slots in place while something reads them.

A forward pass or a transfer that holds physical addresses pins the virtual ids it uses;
compaction never moves, and ``free`` refuses, a pinned id. A gate is ``PINNING`` from the
moment ``GateRegistry.pin`` makes it until it is ``RELEASED``: by ``release()``, or by
itself once its device event (``torch.cuda.Event``) has completed, checked with the
non-blocking ``event.query()``, never ``synchronize()``.

Invariants: ``pins[i]`` equals the number of PINNING gates holding id ``i``; a RELEASED
gate never pins again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np


class DoneEvent(Protocol):
    """What a gate may wait on: anything with a non-blocking ``query()`` (``torch.cuda.Event``)."""

    def query(self) -> bool: ...


class GateStatus(Enum):
    PINNING = "pinning"
    """Its ids cannot move or be freed."""
    RELEASED = "released"
    """It pins nothing any more (released by hand or its event completed)."""


@dataclass(eq=False)
class MoveGate:
    pages: np.ndarray
    slots: np.ndarray
    event: DoneEvent | None = None
    _registry: GateRegistry | None = field(default=None, repr=False)

    @property
    def status(self) -> GateStatus:
        return GateStatus.RELEASED if self._registry is None else GateStatus.PINNING

    def release(self) -> None:
        """Unpin (idempotent)."""
        if self._registry is not None:
            self._registry._release(self)

    def __enter__(self) -> MoveGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class GateRegistry:
    def __init__(self, page_capacity: int, slot_capacity: int):
        self.page_pins = np.zeros(page_capacity, dtype=np.int64)
        self.slot_pins = np.zeros(slot_capacity, dtype=np.int64)
        self._pinning: list[MoveGate] = []

    def pin(self, pages: np.ndarray, slots: np.ndarray, event: DoneEvent | None) -> MoveGate:
        gate = MoveGate(pages.copy(), slots.copy(), event, self)
        np.add.at(self.page_pins, gate.pages, 1)
        np.add.at(self.slot_pins, gate.slots, 1)
        self._pinning.append(gate)
        return gate

    def _release(self, gate: MoveGate) -> None:
        np.subtract.at(self.page_pins, gate.pages, 1)
        np.subtract.at(self.slot_pins, gate.slots, 1)
        self._pinning.remove(gate)
        gate._registry = None

    def sweep(self) -> int:
        """Release gates whose event has completed; returns how many were released."""
        done = [g for g in self._pinning if g.event is not None and g.event.query()]
        for gate in done:
            gate.release()
        return len(done)

    @property
    def pinning_gates(self) -> int:
        """How many gates pin ids now."""
        return len(self._pinning)

    def recount(self) -> tuple[np.ndarray, np.ndarray]:
        pages = np.zeros_like(self.page_pins)
        slots = np.zeros_like(self.slot_pins)
        for gate in self._pinning:
            np.add.at(pages, gate.pages, 1)
            np.add.at(slots, gate.slots, 1)
        return pages, slots
