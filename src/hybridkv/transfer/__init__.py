"""Prefill->decode transfer of KV and recurrent state (PD disaggregation).

Layout (``BufferSet``) -> pairing by global layer id -> plan of coalesced ``(src, dst,
length)`` ops -> a transport chosen by name from one registry (``TRANSPORTS``: shared
memory, Mooncake), written asynchronously (``submit`` -> handle, ``poll``/``wait``), driven
by a control plane (bootstrap registry, per-request messages, forward-only request and leg
status, optional checksums computed on the memory's own device). Fails closed: every size
and address is checked before a byte moves; any doubt ends the request Failed with a reason.

Threat model (an attacker who can reach the zmq ports; ``auth`` has the frame format):
- Without the cluster key it can neither register, replace a rank, say ``Hello``, nor
  forge or replay a status, abort or heartbeat: every frame carries a keyed MAC and a
  per-sender (epoch, sequence) that only grows, and names its addressee; a refused frame
  is logged, counted and changes nothing. So it cannot make any rank write anything. It
  can drop, delay or flood traffic: requests time out and fail closed.
- With the key it is a cluster member (it can fail requests, stall a rank's frames). Even
  then: a registered identity is replaced only by a newer epoch; shm sessions name only
  ``/dev/shm/hybridkv-<token>`` files of this user with a matching header, opened without
  following links; endpoints are ``tcp://host:port``; destinations must lie in the
  layout the peer published, in pools it has.
- Frames and KV bytes are not encrypted (use a private network).
- A failed request's pages are reused only after each writer acknowledged stop or its
  process is proven gone (same host, ``liveness``); never on a timer alone.

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
from hybridkv.transfer.ops import TransferPlan
from hybridkv.transfer.pairing import EntryPair, pair_entries
from hybridkv.transfer.plan import build_plan, memory_cells
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
