"""``MemoryView``: the parts of a ``UnifiedMemory`` that its statistics (``stats.py``) and its consistency check
(``verify.py``) read. ``unified.py`` builds them and calls both; they name this view instead of the class, so
neither imports the module that imports them.
"""

from __future__ import annotations

from typing import Protocol

from hybridkv.memory.arena import Arena
from hybridkv.memory.gates import GateRegistry
from hybridkv.memory.pool import SubPool
from hybridkv.memory.slabs import SlabBroker
from hybridkv.memory.virtual import VirtualIds
from hybridkv.memory.windows import Windows
from hybridkv.spec import PoolId


class MemoryView(Protocol):
    arena: Arena
    pools: dict[PoolId, SubPool]
    pages: VirtualIds
    slots: VirtualIds
    history_pools: list[SubPool]  # token pools that keep every token of a live page
    window_pools: list[SubPool]  # token pools whose pages may leave while the page stays live
    slot_pools: list[SubPool]
    gates: GateRegistry
    windows: Windows
    broker: SlabBroker
