"""Transports that execute transfer plans, by name: where a transport is registered.

``TRANSPORTS`` maps each ``TransportName`` to its class. To add one (NIXL, CUDA IPC): write a
``Transport`` subclass (``submit`` that starts a write and returns a ``WriteHandle`` it ends
once; ``register``, ``session``, ``close``; ``devices`` it can move; what callers must know as
class attributes: ``cross_process``, ``shared_arena``, ``pays_per_op``, ``loopback_options``;
``bench transfer``'s ``bench_goal`` and ``raw_write``, if it has a raw baseline), add its name
to ``catalogue.TransportName`` (outside ``transfer/``: the command line checks names without
importing torch, as ``catalogue`` says) and its class here. The engine, the PD server and the
bench never name a transport: they ask its class.
"""

from __future__ import annotations

from hybridkv.registry import Registry
from hybridkv.transfer.shared import SharedBuffer
from hybridkv.transfer.transport.base import (
    Completion,
    Transport,
    TransportName,
    WriteHandle,
    WriteStatus,
)
from hybridkv.transfer.transport.mooncake import MooncakeTransport
from hybridkv.transfer.transport.shm import ShmTransport
from hybridkv.transfer.transport.writer import write_plan

TRANSPORTS = Registry[type[Transport]]("transport")
TRANSPORTS.add(TransportName.SHM, ShmTransport)
TRANSPORTS.add(TransportName.MOONCAKE, MooncakeTransport)


def transport_class(name: str) -> type[Transport]:
    """The transport class called ``name``; ``ValueError`` naming the known ones otherwise."""
    return TRANSPORTS[name]  # UnknownName (a ValueError) names the known ones


def make_transport(name: str, shared: SharedBuffer | None = None, **options: object) -> Transport:
    """A transport by name; ``shared`` is the buffer peers write into (transports with a
    ``shared_arena`` only: shm); ``options`` go to the transport (Mooncake: ``host``,
    ``protocol``, ``progress_timeout_s``)."""
    return transport_class(name).create(shared, **options)


__all__ = [
    "TRANSPORTS",
    "Completion",
    "MooncakeTransport",
    "ShmTransport",
    "Transport",
    "TransportName",
    "WriteHandle",
    "WriteStatus",
    "make_transport",
    "transport_class",
    "write_plan",
]
