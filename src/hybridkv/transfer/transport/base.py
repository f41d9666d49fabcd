"""The transport interface: move a plan's ``(src, dst, length)`` ops to a peer's memory,
asynchronously: ``submit`` ops, then ``poll`` or ``wait`` on the returned handle.

Invariants:
- A transport writes only into memory the peer registered and only from memory this side
  registered; an op outside either is refused with ``TransportError`` at ``submit`` and
  nothing of that submit moves (the shm transport checks both itself, Mooncake's peer
  checks the destination, which then fails the handle).
- A handle ends exactly once, ``DONE`` (every op landed) or ``FAILED`` with a non-empty
  reason; a failure is never reported as done. After ``FAILED`` the destination bytes are
  undefined and the request must fail. While a handle is ``PENDING`` its source bytes may
  still be read: a caller must not reuse them before the handle ended.
- ``poll`` never blocks; ``wait`` blocks at most its timeout and returns the status then
  (``PENDING`` if it has not ended). A transport may complete a handle inside ``submit``
  (shm copies synchronously) or later (Mooncake): the API is the same.
- ``bounds``, when given, hold every op (a plan derives them from its checked cell ids);
  a transport may check them instead of reducing the op arrays, never skip the check.
- The same plan arrays drive every transport.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from hybridkv.catalogue import TransportName
from hybridkv.transfer.errors import TransferError, TransportError
from hybridkv.transfer.ops import Bounds, Ops
from hybridkv.transfer.shared import SharedBuffer


class Completion(Enum):
    """How far a submitted write got."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class WriteStatus:
    """Where a submitted write stands; ``reason`` says why it failed (empty otherwise)."""

    completion: Completion
    reason: str = ""
    ended: bool = field(init=False, repr=False, compare=False)  # done or failed (a plain read: hot path)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ended", self.completion is not Completion.PENDING)


PENDING = WriteStatus(Completion.PENDING)
DONE = WriteStatus(Completion.DONE)


class WriteHandle:
    """One submitted write of ``ops`` ops to ``peer``.

    Its transport ends it once with ``finish``; anyone may read ``status`` (thread-safe).
    """

    __slots__ = ("_ended", "_status", "ops", "peer")

    def __init__(self, peer: str, ops: int, status: WriteStatus = PENDING) -> None:
        """``status``: ``DONE`` for a write that completed inside ``submit`` (no event needed)."""
        self.peer, self.ops = peer, ops
        self._status = status
        self._ended = None if status.ended else threading.Event()

    @property
    def status(self) -> WriteStatus:
        return self._status

    def finish(self, status: WriteStatus) -> None:
        """End the handle (transports only); a second end is a bug and raises."""
        if not status.ended or (status.completion is Completion.FAILED and not status.reason):
            raise ValueError(f"a write ends done or failed with a reason, not {status}")
        if self._ended is None or self._ended.is_set():
            raise RuntimeError(f"write to {self.peer} ended twice: {self._status}, then {status}")
        self._status = status
        self._ended.set()

    def wait(self, timeout_s: float | None) -> WriteStatus:
        if self._ended is not None:
            self._ended.wait(timeout_s)
        return self._status


@dataclass(frozen=True)
class BenchGoal:
    """What ``hybridkv bench transfer`` holds a transport to: hybridkv's GB/s at least ``ratio`` x
    those of the transport's raw baseline (``Transport.raw_write``: the same ops, no plan, no
    checks) for pages of ``from_page_bytes`` or more."""

    baseline: str  # what the raw baseline does, as the report names it
    ratio: float
    from_page_bytes: int = 0
    copy_bound: bool = False
    """The transport copies with this host's CPU: one contiguous ``memmove`` of as many bytes
    bounds it, and the report shows that bound (``memcpy_block``)."""


class Transport(ABC):
    name: ClassVar[TransportName]
    max_ops_per_submit: ClassVar[int]
    """Ops one ``submit`` should carry at most (``write_plan`` splits plans into chunks)."""
    cross_process: ClassVar[bool]
    """A peer in another process can be written to. False: both sides must live in one process (a
    rig's transport), which a disaggregated server, one process a rank, refuses (``PDConfig``).
    Every transport states it (no default)."""
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    """Memory kinds the transport can move (both transports here move host memory)."""
    shared_arena: ClassVar[bool] = False
    """The receiving side's arena must be a ``SharedBuffer`` peers map (shm)."""
    pays_per_op: ClassVar[bool] = False
    """Each op costs a fixed time of its own (Mooncake TCP): senders stage strided sources
    (``staging.SourceStaging``) so that a chunk goes out as one op per destination run."""
    loopback_options: ClassVar[Mapping[str, object]] = {}
    """``create`` options for peers that all run on this host (a PD server's processes)."""
    bench_goal: ClassVar[BenchGoal | None] = None
    """``bench transfer``'s goal against ``raw_write``; None: the bench reports no baseline."""
    waits_inline: ClassVar[bool] = False
    """``submit_wait`` runs a write on the caller's thread (no hand-off to a thread that ends
    the handle): ``write_plan`` uses it for a plan that fits one chunk (Mooncake: a thread
    hand-off and wake-up cost ~60 µs of a 64 KiB x 16 write, measured)."""

    @classmethod
    def create(cls, shared: SharedBuffer | None = None, **options: object) -> Transport:
        """A transport of this class; ``shared``: the buffer peers write into (used only
        where ``shared_arena``)."""
        return cls(**options)

    def check_device(self, device: str) -> None:
        """Refuse memory this transport cannot touch, before any address is used."""
        if device not in self.devices:
            raise TransferError(
                f"the {self.name} transport moves {sorted(self.devices)} memory, this memory is on "
                f"{device!r}; use a host (cpu) memory or a transport for {device!r}"
            )

    @property
    @abstractmethod
    def session(self) -> str:
        """How a peer addresses this side's registered memory."""

    @abstractmethod
    def check_session(self, session: str) -> None:
        """Refuse (``TransportError``) a peer session this transport would not write to, before
        anything is opened or connected (a peer's ``Hello`` names its session)."""

    @abstractmethod
    def register(self, addr: int, length: int) -> None:
        """Expose ``[addr, addr + length)`` of this process to transfers."""

    @abstractmethod
    def submit(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> WriteHandle:
        """Start copying ``length[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]``.

        The ops come as int64 arrays or lists of ints (as the plan holds them), at most
        ``max_ops_per_submit`` of them. ``bounds``: address ranges that hold every op, when
        the caller knows them. Raises ``TransportError`` (nothing moved) for ops it refuses.
        """

    def warm(self, session: str) -> None:
        """Prepare writes to the peer ``session`` (a connection, its metadata) so that the first
        write does not pay for it; optional, never raises: a write reports what is wrong."""
        del session  # nothing to prepare unless a transport says otherwise

    def poll(self, handle: WriteHandle) -> WriteStatus:
        """Where ``handle`` stands now, without blocking."""
        return handle.status

    def wait(self, handle: WriteHandle, timeout_s: float | None) -> WriteStatus:
        """Block until ``handle`` ended or ``timeout_s`` passed (None: no limit)."""
        return handle.wait(timeout_s)

    def submit_wait(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> WriteStatus:
        """``submit`` and block until the write ended; returns how it ended (never ``PENDING``).
        The same refusals as ``submit`` (``TransportError``, nothing moved), the same end."""
        return self.wait(self.submit(peer, src, dst, length, bounds), None)

    def write(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> None:
        """``submit`` and wait for the end; raises ``TransportError`` unless every op landed."""
        status = self.wait(self.submit(peer, src, dst, length, bounds), None)
        if status.completion is not Completion.DONE:
            raise TransportError(status.reason)

    def raw_write(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> None:
        """``bench transfer``'s raw baseline: the ops moved to the peer as plainly as the transport's
        own machinery allows, with no plan, no checks and no handle (transports with a ``bench_goal``)."""
        raise NotImplementedError(f"the {self.name} transport has no raw baseline: its bench_goal is None")

    @abstractmethod
    def close(self) -> None:
        """Release the transport's resources (idempotent)."""
