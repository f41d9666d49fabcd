"""Move gates: pins that keep pages and state slots in place while something reads them.

A forward pass or a transfer that holds physical addresses pins the virtual ids it uses;
compaction never moves, and ``free`` refuses, a pinned id. A gate may carry a device event
(``torch.cuda.Event``): once the event has completed the gate opens by itself, checked with
the non-blocking ``event.query()``, never ``synchronize()``.

Invariant: ``pins[i]`` equals the number of open gates holding id ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class _Event(Protocol):
    def query(self) -> bool: ...


@dataclass(eq=False)
class MoveGate:
    pages: np.ndarray
    slots: np.ndarray
    event: _Event | None = None
    _registry: GateRegistry | None = field(default=None, repr=False)

    @property
    def is_open(self) -> bool:
        return self._registry is None

    def release(self) -> None:
        """Unpin (idempotent)."""
        if self._registry is not None:
            self._registry._close(self)

    def __enter__(self) -> MoveGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class GateRegistry:
    def __init__(self, page_capacity: int, slot_capacity: int):
        self.page_pins = np.zeros(page_capacity, dtype=np.int64)
        self.slot_pins = np.zeros(slot_capacity, dtype=np.int64)
        self._gates: list[MoveGate] = []

    def open(self, pages: np.ndarray, slots: np.ndarray, event: _Event | None) -> MoveGate:
        gate = MoveGate(pages.copy(), slots.copy(), event, self)
        np.add.at(self.page_pins, gate.pages, 1)
        np.add.at(self.slot_pins, gate.slots, 1)
        self._gates.append(gate)
        return gate

    def _close(self, gate: MoveGate) -> None:
        np.subtract.at(self.page_pins, gate.pages, 1)
        np.subtract.at(self.slot_pins, gate.slots, 1)
        self._gates.remove(gate)
        gate._registry = None

    def sweep(self) -> int:
        """Release gates whose event has completed; returns how many were released."""
        done = [g for g in self._gates if g.event is not None and g.event.query()]
        for gate in done:
            gate.release()
        return len(done)

    @property
    def open_gates(self) -> int:
        return len(self._gates)

    def recount(self) -> tuple[np.ndarray, np.ndarray]:
        pages = np.zeros_like(self.page_pins)
        slots = np.zeros_like(self.slot_pins)
        for gate in self._gates:
            np.add.at(pages, gate.pages, 1)
            np.add.at(slots, gate.slots, 1)
        return pages, slots
