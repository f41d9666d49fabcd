"""The transport interface: move a plan's ``(src, dst, length)`` ops to a peer's memory.

Invariants:
- A transport writes only into memory the peer registered and only from memory this side
  registered; an op outside either is refused with ``TransportError`` (the shm transport
  checks both itself, Mooncake's peer checks the destination).
- ``write`` returns only when every op landed, or raises ``TransportError``; after an error
  the destination bytes are undefined and the request must fail.
- ``bounds``, when given, hold every op (a plan derives them from its checked cell ids);
  a transport may check them instead of reducing the op arrays, never skip the check.
- The same plan arrays drive every transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from hybridkv.transfer.errors import TransferError
from hybridkv.transfer.plan import Bounds, Ops, TransferPlan


class Transport(ABC):
    name: ClassVar[str]
    max_ops_per_write: ClassVar[int]
    """Ops one ``write`` call should carry at most (the caller splits plans into chunks)."""
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    """Memory kinds the transport can move (both transports here move host memory)."""

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
    def register(self, addr: int, length: int) -> None:
        """Expose ``[addr, addr + length)`` of this process to transfers."""

    @abstractmethod
    def write(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> None:
        """Copy ``length[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]``, all or raise.

        The ops come as int64 arrays or lists of ints (as the plan holds them).

        ``bounds``: address ranges that hold every op, when the caller knows them.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the transport's resources (idempotent)."""


class Delegating(Transport):
    """A transport that forwards everything to ``inner``; subclasses change one behaviour
    (e.g. slow or faulty writes for fault tests and demos)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.max_ops_per_write = inner.max_ops_per_write  # type: ignore[misc]
        self.devices = inner.devices  # type: ignore[misc]

    @property
    def session(self) -> str:
        return self.inner.session

    def register(self, addr: int, length: int) -> None:
        self.inner.register(addr, length)

    def write(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> None:
        self.inner.write(peer, src, dst, length, bounds)

    def close(self) -> None:
        self.inner.close()


def write_plan(transport: Transport, peer: str, plan: TransferPlan, chunk_bytes: int, stop: Callable[[], str]) -> None:
    """Write ``plan`` in chunks (at most ``max_ops_per_write`` ops, about ``chunk_bytes``).

    ``stop()`` is asked before every chunk; a non-empty answer ends the write with
    ``TransferError("stopped: <answer>")``, so an abort or a deadline takes effect at the
    next chunk boundary.
    """
    for chunk in plan.chunks(transport.max_ops_per_write, chunk_bytes):
        reason = stop()
        if reason:
            raise TransferError(f"stopped: {reason}")
        transport.write(peer, *plan.ops(chunk), plan.bounds)
