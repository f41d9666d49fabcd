"""Prefill->decode transfer of KV and recurrent state (PD disaggregation).

Layout (``BufferSet``) -> pairing by global layer id -> plan of coalesced ``(src, dst,
length)`` ops -> a transport chosen by name from one registry (``TRANSPORTS``: shared
memory, Mooncake), written asynchronously (``submit`` -> handle, ``poll``/``wait``), driven
by a control plane (bootstrap registry, per-request messages, forward-only request and leg
status, optional checksums computed on the memory's own device). Fails closed: every size
and address is checked before a byte moves; any doubt ends the request Failed with a reason.

Test and demo tooling (byte patterns, multi-process harness, fault-injecting transports)
lives in ``hybridkv.testing``, which this package never imports.
"""

from hybridkv.transfer.auth import AuthError, ClusterKey, load_cluster_key
from hybridkv.transfer.bootstrap import BootstrapServer
from hybridkv.transfer.buffers import (
    BufferEntry,
    BufferSet,
    Role,
    buffer_set_from_layouts,
    buffer_set_from_memory,
    expand_layer_ids,
)
from hybridkv.transfer.decode import Allocation, DecodeReceiver, ReceiverStats
from hybridkv.transfer.errors import (
    BadLayout,
    LayoutMismatch,
    PlanError,
    ProtocolError,
    TransferError,
    TransportError,
)
from hybridkv.transfer.pairing import EntryPair, pair_entries
from hybridkv.transfer.plan import TransferPlan, build_plan, memory_cells
from hybridkv.transfer.prefill import PrefillSender
from hybridkv.transfer.shared import SharedBuffer, shared_memory
from hybridkv.transfer.status import LegStatus, Phase, RequestStatus, StatusReport
from hybridkv.transfer.transport import TRANSPORTS, Transport, TransportName, make_transport

__all__ = [
    "TRANSPORTS",
    "Allocation",
    "AuthError",
    "BadLayout",
    "BootstrapServer",
    "BufferEntry",
    "BufferSet",
    "ClusterKey",
    "DecodeReceiver",
    "EntryPair",
    "LayoutMismatch",
    "LegStatus",
    "Phase",
    "PlanError",
    "PrefillSender",
    "ProtocolError",
    "ReceiverStats",
    "RequestStatus",
    "Role",
    "SharedBuffer",
    "StatusReport",
    "TransferError",
    "TransferPlan",
    "Transport",
    "TransportError",
    "TransportName",
    "buffer_set_from_layouts",
    "buffer_set_from_memory",
    "build_plan",
    "expand_layer_ids",
    "load_cluster_key",
    "make_transport",
    "memory_cells",
    "pair_entries",
    "shared_memory",
]
