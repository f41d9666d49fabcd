"""Transports that execute transfer plans: shared-memory copy and the Mooncake engine."""

from __future__ import annotations

from hybridkv.transfer.shared import SharedBuffer
from hybridkv.transfer.transport.base import Transport, write_plan
from hybridkv.transfer.transport.shm import ShmTransport

TRANSPORTS = ("shm", "mooncake")


def make_transport(name: str, shared: SharedBuffer | None = None, **options: object) -> Transport:
    """A transport by name; ``shared`` is the shm buffer peers write into (shm only)."""
    if name == "shm":
        return ShmTransport(shared)
    if name == "mooncake":
        from hybridkv.transfer.transport.mooncake import MooncakeTransport

        return MooncakeTransport(**options)  # type: ignore[arg-type]
    raise ValueError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}")


__all__ = ["TRANSPORTS", "ShmTransport", "Transport", "make_transport", "write_plan"]
