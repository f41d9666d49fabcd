"""Mooncake transfer engine transport: TCP (RDMA where the host has devices).

Uses ``mooncake.engine.TransferEngine`` in P2P-handshake mode (no metadata server); the
session is ``host:rpc_port``. Facts this module relies on (probed on the wheel
``mooncake-transfer-engine-non-cuda`` 0.3.13):
- sync batch writes return 0 (all ops landed) or -1 (any failure); the peer refuses
  destinations outside what it registered;
- more than ~2,000 ops in flight to one peer overflows its TCP queue, after which that
  path stays broken; ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` raises the limit and must be
  in the environment before ``initialize``, ``MC_LOG_LEVEL`` before the import;
- a -1 right after a refused op is sometimes spurious: retry once, then probe the peer.

Invariants:
- A write call carries at most ``max_ops_per_write`` ops (well under the queue limit);
  any -1 that survives the retry raises ``TransportError`` naming the peer and whether it
  answers a probe. A failure is never reported as success.
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridkv.transfer.errors import TransportError
from hybridkv.transfer.plan import Bounds, Ops, as_ints
from hybridkv.transfer.transport.base import Transport

ENV_DEFAULTS = {
    "MC_LOG_LEVEL": "ERROR",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
}
PROBE_DEAD = -102


def rdma_present() -> bool:
    path = Path("/sys/class/infiniband")
    return path.is_dir() and any(path.iterdir())


class MooncakeTransport(Transport):
    name = "mooncake"
    max_ops_per_write = 1024

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "auto",
        progress_timeout_s: int | None = None,
    ) -> None:
        """``protocol``: "tcp", "rdma" or "auto" (RDMA when the host has devices).

        ``progress_timeout_s`` bounds how long a write to a hung peer may block (Mooncake's
        default is 30 s); it is set in the environment before the engine starts.
        """
        for key, value in ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if progress_timeout_s is not None:
            os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(progress_timeout_s)
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, progress_timeout_s))
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransportError(
                f"the mooncake transport needs the package mooncake-transfer-engine-non-cuda (and libibverbs1): {exc}"
            ) from None
        if protocol == "auto":
            protocol = "rdma" if rdma_present() else "tcp"
        self.protocol = protocol
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransportError(f"mooncake initialize({host!r}, {protocol!r}) failed with rc {rc}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []

    @property
    def session(self) -> str:
        return self._session

    @property
    def engine(self) -> object:
        """The underlying ``TransferEngine`` (for raw-engine baselines in benchmarks)."""
        return self._engine

    def register(self, addr: int, length: int) -> None:
        rc = self._engine.register_memory(addr, length)
        if rc != 0:
            raise TransportError(
                f"mooncake register_memory({addr:#x}, {length}) failed with rc {rc} (-7: overlaps a registered region)"
            )
        self._registered.append(addr)

    def write(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> None:
        """The peer's engine checks every destination itself; ``bounds`` are not needed."""
        if len(src) > self.max_ops_per_write:
            raise TransportError(
                f"{len(src)} ops in one mooncake write; split plans into chunks of at most "
                f"{self.max_ops_per_write} (more can overflow the peer's queue)"
            )
        args = (peer, as_ints(src), as_ints(dst), as_ints(length))
        rc = self._engine.batch_transfer_sync_write(*args)
        if rc != 0:
            rc = self._engine.batch_transfer_sync_write(*args)
        if rc != 0:
            probe = self._engine.send_probe(peer)
            state = "dead" if probe == PROBE_DEAD else f"answering probes (probe rc {probe})"
            raise TransportError(
                f"mooncake batch write of {len(src)} ops ({sum(args[3])} B) to {peer} failed "
                f"with rc {rc} after one retry; the peer is {state}"
            )

    def close(self) -> None:
        if self._engine is None:
            return
        for addr in self._registered:
            self._engine.unregister_memory(addr)
        self._registered.clear()
        self._engine = None
