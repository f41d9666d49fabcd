"""Idle Mooncake Store clients of this process, kept for the next tier set up against their master.

Closing a ``MooncakeDistributedStore`` joins its ping thread while holding the GIL: 1-2 s in which
no thread of this process runs. A ``MooncakeStoreTier`` that closes hands its client back here
instead, after unmounting its segment (the segment and every object in it leave the store at once);
the next tier set up with the same master and local settings takes the client and mounts a segment
of its own.

Invariants:
- A pooled client has no segment mounted: the store holds no memory of a closed tier.
- At most ``KEEP`` idle clients per (master, local settings); one more is closed instead.
- ``forget(master)`` closes the idle clients of a master that is going away (``MooncakeMaster.stop``),
  so none of them is left pinging a dead master; at interpreter exit every idle client is closed.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

KEEP = 4
ClientKey = tuple[str, str, str, int]
"""(master address, local hostname, protocol, local buffer bytes): what ``setup`` fixed."""

_idle: dict[ClientKey, list[Any]] = {}
_lock = threading.Lock()


def take(key: ClientKey) -> Any | None:
    """An idle client set up with ``key``, or None."""
    with _lock:
        clients = _idle.get(key)
        return clients.pop() if clients else None


def give(key: ClientKey, client: Any) -> None:
    """Keep ``client`` (its segment already unmounted) for the next ``take(key)``."""
    with _lock:
        clients = _idle.setdefault(key, [])
        if len(clients) < KEEP:
            clients.append(client)
            return
    client.close()


def forget(master: str) -> None:
    """Close every idle client of ``master``."""
    with _lock:
        gone = [c for key in [k for k in _idle if k[0] == master] for c in _idle.pop(key)]
    for client in gone:
        client.close()


def _close_all() -> None:
    for master in {key[0] for key in list(_idle)}:
        forget(master)


atexit.register(_close_all)
