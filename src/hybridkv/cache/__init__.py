"""A prefix cache for hybrid models: a hit is valid only where every component is.

Full KV must cover the whole hit, every sliding-window pool the window before its end, and
a recurrent-state checkpoint must sit exactly at its end. ``HybridRadixCache`` answers hits
over a radix tree; ``KVManager`` drives each request's ``KVHandle`` above it (allocation
with eviction, window release, checkpoints, insert, release). Built on ``hybridkv.memory``
(virtual page ids, host tables); never imports ``hybridkv.transfer``.
"""

from hybridkv.cache.errors import CacheError, InsertError, LockError
from hybridkv.cache.events import CacheEvent, EventKind, EventLog
from hybridkv.cache.handle import HandleStatus, KVHandle
from hybridkv.cache.locks import CacheLock
from hybridkv.cache.manager import KVManager
from hybridkv.cache.node import Node
from hybridkv.cache.placement import CheckpointPlacement, PlacementError
from hybridkv.cache.policies import POLICIES, Policy, RecomputeCost, make_policy
from hybridkv.cache.prefix_cache import HybridRadixCache, InsertResult, MatchResult
from hybridkv.cache.residency import PAGE_NEED
from hybridkv.cache.rules import ComponentKind, HitRules

__all__ = [
    "PAGE_NEED",
    "POLICIES",
    "CacheError",
    "CacheEvent",
    "CacheLock",
    "CheckpointPlacement",
    "ComponentKind",
    "EventKind",
    "EventLog",
    "HandleStatus",
    "HitRules",
    "HybridRadixCache",
    "InsertError",
    "InsertResult",
    "KVHandle",
    "KVManager",
    "LockError",
    "MatchResult",
    "Node",
    "PlacementError",
    "Policy",
    "RecomputeCost",
    "make_policy",
]
