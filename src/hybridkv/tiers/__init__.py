"""Storage tiers below the device for KV pages *and* recurrent-state checkpoints.

Host memory (``HostTier``: its own byte budget, LRU, pinned where a CUDA device makes that
worthwhile), the Mooncake Store (``MooncakeStoreTier``, a distributed store several engine
hosts share; ``MooncakeMaster`` starts its master on loopback for tests and demos; a closed
tier's client waits in ``mooncake_clients`` for the next tier on its master) and an
in-process dict (``DictStore``: unit tests, and the simulated store of replay sweeps) share
one asynchronous, batched interface (``StorageTier``). Objects are one page of one pool or
one state checkpoint, framed with their key's digest, size and CRC-32 (``framing.py``),
under content-addressed keys namespaced by the model spec, layer range, PP/TP shard, page
size and pool layout (``keys.py``).

``TierHierarchy`` hangs below a prefix cache (its ``ResidencyHook``): it writes what the
device caches (write-through) or evicts (write-back: device -> host -> store), plans hits
across tiers by the same per-kind rules as the device (``hit.cross_tier_hit``, a pure
function), fetches and commits them into reserved pages and slots (``restore.py``).

Depends on ``spec``, ``memory`` and ``cache`` only; nothing below imports it.
"""

from hybridkv.tiers.base import PutStatus, StorageTier, Ticket, TierError, TierStats, TierTimeout
from hybridkv.tiers.counters import TierCounters
from hybridkv.tiers.device import DeviceView, device_view
from hybridkv.tiers.dict_store import DictStore
from hybridkv.tiers.framing import MissReason
from hybridkv.tiers.hierarchy import TierHierarchy, WritePolicy
from hybridkv.tiers.hit import Residency, TierHit, Where, cross_tier_hit
from hybridkv.tiers.host import HostTier
from hybridkv.tiers.keys import KeySpace
from hybridkv.tiers.master import MooncakeMaster
from hybridkv.tiers.mooncake_store import MooncakeStoreTier
from hybridkv.tiers.restore import Fetched, TierPlan

__all__ = [
    "DeviceView",
    "DictStore",
    "Fetched",
    "HostTier",
    "KeySpace",
    "MissReason",
    "MooncakeMaster",
    "MooncakeStoreTier",
    "PutStatus",
    "Residency",
    "StorageTier",
    "Ticket",
    "TierCounters",
    "TierError",
    "TierHierarchy",
    "TierHit",
    "TierPlan",
    "TierStats",
    "TierTimeout",
    "Where",
    "WritePolicy",
    "cross_tier_hit",
    "device_view",
]
