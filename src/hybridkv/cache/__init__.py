"""A prefix cache for hybrid models: a hit is valid only where every component is.

Full KV must cover the whole hit, every sliding-window pool the window before its end, and
a recurrent-state checkpoint must sit exactly at its end. Built on ``hybridkv.memory``
(virtual page ids, host tables); never imports ``hybridkv.transfer``.
"""

from hybridkv.cache.components import Components, Window
from hybridkv.cache.errors import CacheError, InsertError, LockError
from hybridkv.cache.events import CacheEvent, EventKind, EventLog
from hybridkv.cache.eviction import PAGE_NEED
from hybridkv.cache.node import Node
from hybridkv.cache.policies import POLICIES, Policy, RecomputeCost, make_policy
from hybridkv.cache.request import RequestKV
from hybridkv.cache.tree import (
    CacheLock,
    HybridRadixCache,
    InsertResult,
    MatchResult,
)

__all__ = [
    "PAGE_NEED",
    "POLICIES",
    "CacheError",
    "CacheEvent",
    "CacheLock",
    "Components",
    "EventKind",
    "EventLog",
    "HybridRadixCache",
    "InsertError",
    "InsertResult",
    "LockError",
    "MatchResult",
    "Node",
    "Policy",
    "RecomputeCost",
    "RequestKV",
    "Window",
    "make_policy",
]
