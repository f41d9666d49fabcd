"""One byte budget per device for full-attention KV, sliding-window KV and recurrent state."""

from hybridkv.memory.errors import (
    InvalidIds,
    LayoutError,
    MemoryPoolError,
    OutOfMemory,
    PinnedError,
)
from hybridkv.memory.gates import GateStatus, MoveGate
from hybridkv.memory.layout import CellLayout, Segment, build_layouts
from hybridkv.memory.sizing import MemoryHints, MemoryPlan, plan_memory
from hybridkv.memory.stats import MemoryStats, PoolStats
from hybridkv.memory.tokens import TokenAllocator
from hybridkv.memory.unified import UnifiedMemory
from hybridkv.units import format_bytes, parse_bytes

__all__ = [
    "CellLayout",
    "GateStatus",
    "InvalidIds",
    "LayoutError",
    "MemoryHints",
    "MemoryPlan",
    "MemoryPoolError",
    "MemoryStats",
    "MoveGate",
    "OutOfMemory",
    "PinnedError",
    "PoolStats",
    "Segment",
    "TokenAllocator",
    "UnifiedMemory",
    "build_layouts",
    "format_bytes",
    "parse_bytes",
    "plan_memory",
]
