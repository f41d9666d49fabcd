"""Residency events a router can follow: which pages (and states) the cache stores or drops.

Pages are named by chained block hashes, like other engines' KV events: the hash of page
``i`` is ``hash((hash of page i-1, its token bytes))``, starting from a per-namespace root
hash, so two trees (or a tree and a router) that saw the same tokens agree on every name,
and splitting a node renames nothing. Each event carries one component (a pool name:
``"full"``, ``"mla"``, ``"swa:<window>"`` or ``"state"``).

Invariants:
- Events are emitted only after the change they describe has happened, in order.
- For every component, following the events from an empty cache gives exactly the set of
  resident pages (and state checkpoints) the tree holds; ``tests/cache`` replays them into
  an oracle to prove it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class CacheEvent:
    kind: EventKind
    component: str
    namespace: Any
    block_hashes: tuple[int, ...]
    parent_hash: int | None = None
    """For stored full-KV pages: the hash of the page before the first one."""
    tokens: tuple[int, ...] | None = None
    """For stored full-KV pages: their token ids, page after page."""


def root_hash(namespace: Any) -> int:
    return hash(("hybridkv-root", namespace))


def chain_hashes(parent_hash: int, key: np.ndarray, page_size: int) -> list[int]:
    """Chained hashes of the pages of ``key`` (a whole number of pages)."""
    out = []
    h = parent_hash
    data = key.tobytes()
    step = page_size * key.itemsize
    for off in range(0, len(data), step):
        h = hash((h, data[off : off + step]))
        out.append(h)
    return out


class EventLog:
    """Buffers events when enabled; ``drain()`` hands them over and empties the buffer."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self._events: list[CacheEvent] = []

    def emit(self, event: CacheEvent) -> None:
        self._events.append(event)

    def drain(self) -> list[CacheEvent]:
        out, self._events = self._events, []
        return out

    def __len__(self) -> int:
        return len(self._events)
