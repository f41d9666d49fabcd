"""Control-plane messages: typed msgspec schemas, msgpack on the wire.

Invariants:
- Messages travel inside authenticated frames (``hybridkv.transfer.auth``): every field
  here is only ever read after the frame's MAC, addressee and sequence were checked, and
  a message's ``rank`` must be the frame's sender.
- Every message is one tagged struct of ``Message``; unknown tags, unknown fields, wrong
  types and layouts that fail their own checks are rejected by ``auth.Gate.open``
  with a ``ProtocolError`` (the caller logs and drops it; a peer never crashes on input).
- Messages about one request carry the decode-chosen ``nonce``; a message whose nonce,
  request id or sender does not match what the receiver expects is dropped as forged,
  late or duplicate, never applied.
"""

from __future__ import annotations

import msgspec

from hybridkv.transfer.buffers import BufferSet
from hybridkv.transfer.status import LegStatus
from hybridkv.transfer.transport.base import TransportName


class Rank(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank of one engine: who sent a message."""

    engine: str
    pp: int
    tp: int

    def __str__(self) -> str:
        return f"{self.engine}[pp{self.pp} tp{self.tp}]"


class Process(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which OS process a rank runs in: lets a peer on the same host tell whether it is gone.

    ``host`` names the kernel boot and the pid namespace (two processes compare pids only
    when their ``host`` is equal); ``start`` is the process's start time in clock ticks
    since boot (``/proc/<pid>/stat`` field 22), so a reused pid is not mistaken for it.
    """

    host: str
    pid: int
    start: int


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class Register(_Msg, tag="register", frozen=True):
    """Prefill rank -> bootstrap: where to reach me and what I expose.

    ``epoch`` equals the epoch of the frame that carried it (the bootstrap checks): a
    registered rank is replaced only by a newer epoch, and heartbeats and statuses of this
    rank count only from this epoch. ``process``: where the writer runs (quarantine).
    """

    rank: Rank
    endpoint: str
    transport: TransportName
    session: str
    buffers: BufferSet
    epoch: int
    process: Process


class RegisterAck(_Msg, tag="register_ack", frozen=True):
    ok: bool
    reason: str


class Lookup(_Msg, tag="lookup", frozen=True):
    """Decode rank -> bootstrap: the ranks of a prefill engine."""

    engine: str


class LookupReply(_Msg, tag="lookup_reply", frozen=True):
    engine: str
    ranks: tuple[Register, ...]
    complete: bool
    reason: str


class Hello(_Msg, tag="hello", frozen=True):
    """Decode rank -> prefill rank, once per pair: my layout and how to write to me."""

    rank: Rank
    endpoint: str
    transport: TransportName
    session: str
    buffers: BufferSet


class TransferRequest(_Msg, tag="request", frozen=True):
    """Decode rank -> every prefill rank: where request ``request_id`` must land."""

    request_id: str
    nonce: int
    rank: Rank
    seq_len: int
    dst_cells: dict[str, list[int]]
    ttl_s: float
    checksum: bool


class Abort(_Msg, tag="abort", frozen=True):
    request_id: str
    nonce: int
    rank: Rank
    reason: str


class Status(_Msg, tag="status", frozen=True):
    """Prefill rank -> decode rank: progress of one request on this prefill rank."""

    request_id: str
    nonce: int
    rank: Rank
    phase: LegStatus  # never ``asked``: a receiver drops such a status
    reason: str = ""
    ops: int = 0
    nbytes: int = 0
    checksum: int | None = None


class Heartbeat(_Msg, tag="heartbeat", frozen=True):
    rank: Rank
    endpoint: str


Message = Register | RegisterAck | Lookup | LookupReply | Hello | TransferRequest | Abort | Status | Heartbeat
