"""Mooncake transfer engine transport: TCP (RDMA where the host has devices).

Uses ``mooncake.engine.TransferEngine`` in P2P-handshake mode (no metadata server); the
session is ``host:rpc_port``. Facts this module relies on (probed on the wheel
``mooncake-transfer-engine-non-cuda`` 0.3.13):
- a batch ends 0 (all ops landed) or -1 (any failure) in ``get_batch_transfer_status``,
  which blocks until then (``transfer_check_status`` reads only a batch's first op); the
  peer refuses destinations outside what it registered;
- more than ~2,000 ops in flight to one peer overflows its TCP queue, after which that
  path stays broken; ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` raises the limit and must be
  in the environment before ``initialize``, ``MC_LOG_LEVEL`` before the import;
- a -1 right after a refused op is sometimes spurious: retry once, then probe the peer.

Start-up log: in P2P-handshake mode ``initialize`` looks its own segment up before it has
published one, and glog (never initialised by the library) prints, once per process,
"WARNING: Logging before InitGoogleLogging() is written to STDERR" and, per engine,
"E... transfer_metadata.cpp:...] Local segment descriptor not found". Both are harmless
(the descriptor is created right after; transfers work). ``initialize`` therefore runs with
fd 2 captured (``hybridkv.native_log.init_log``): exactly those lines are dropped, every other line the process
wrote meanwhile goes back to stderr, and a failed ``initialize`` quotes them in its error.
Later glog lines (e.g. a refused connection during a transfer) are never touched.

Writes are asynchronous: ``submit`` starts a batch (``batch_transfer_async_write``) and
hands it to the peer's collector thread, which waits for it
(``get_batch_transfer_status``, with the GIL released) and ends the handle.

Invariants:
- A submit carries at most ``max_ops_per_submit`` ops (well under the queue limit); a
  batch that fails is submitted once more, and a failure that survives the retry ends
  the handle ``FAILED`` with a reason naming the peer and whether it answers a probe. A
  failure is never reported as done.
- ``warm`` never raises and blocks at most ``WARM_WAIT_S``; at most one handshake per peer
  session is in flight at a time (a silent peer holds one daemon thread, never the caller).
- One collector thread per peer (started at the first submit to it, kept for the
  transport's life) ends that peer's handles in submission order; a slow peer never
  delays another peer's handles. ``close`` stops the collectors.
- ``submit_wait`` does a collector's work for one batch on the caller's thread (the same
  retry, probe and statuses), so a one-chunk write pays no thread hand-off; it never
  touches the collectors' queues.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hybridkv.native_log import init_log
from hybridkv.transfer.errors import TransportError
from hybridkv.transfer.ops import Bounds, Ops, as_ints
from hybridkv.transfer.transport.base import (
    DONE,
    BenchGoal,
    Completion,
    Transport,
    TransportName,
    WriteHandle,
    WriteStatus,
)

ENV_DEFAULTS = {
    "MC_LOG_LEVEL": "ERROR",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
}
PROBE_DEAD = -102
_HOST = re.compile(r"[0-9A-Za-z.\-]+|\[[0-9A-Fa-f:.]+\]")
CLOSE_WAIT_S = 5.0
WARM_WAIT_S = 0.5
"""How long ``warm`` waits for a handshake (~1-10 ms when the peer answers); a slower one goes on
in its own thread while the caller moves on (the first write then waits for the peer itself)."""
log = logging.getLogger("hybridkv.transfer")

_Batch = tuple[WriteHandle, tuple[str, list[int], list[int], list[int]], int]  # handle, args, batch id


def _started(batch: int) -> bool:
    """A batch id is the address of the engine's batch descriptor; a failed submit gives 0
    (or -1 seen unsigned), which must never reach ``get_batch_transfer_status``."""
    return 0 < batch < 1 << 63


def rdma_present() -> bool:
    path = Path("/sys/class/infiniband")
    return path.is_dir() and any(path.iterdir())


class MooncakeTransport(Transport):
    name = TransportName.MOONCAKE
    max_ops_per_submit = 1024
    cross_process = True  # a peer's session names its host and port
    pays_per_op = True  # every op is a transfer of its own over TCP (~35 us idle, measured)
    waits_inline = True  # submit_wait: the batch and its wait on the caller's thread
    bench_goal = BenchGoal("raw mooncake batch write of the same ops", 0.9)
    loopback_options = MappingProxyType({"host": "127.0.0.1", "protocol": "tcp"})

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
        with init_log() as said:
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransportError(
                f"mooncake initialize({host!r}, {protocol!r}) failed with rc {rc}; it logged: "
                + (" | ".join(said) or "nothing")
            )
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._collectors: dict[str, tuple[queue.SimpleQueue[_Batch | None], threading.Thread]] = {}
        self._lock = threading.Lock()
        self._warming: set[str] = set()  # peer sessions a warm-up handshake is running for

    @property
    def session(self) -> str:
        return self._session

    def check_session(self, session: str) -> None:
        """A Mooncake session is ``host:port`` (what ``session`` gives)."""
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or not _HOST.fullmatch(host):
            raise TransportError(f"not a mooncake session: {session!r} (want host:port)")

    def raw_write(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> None:
        """One ``batch_transfer_sync_write`` of all the ops on this side's engine (no split into submits)."""
        if self._engine is None:
            raise TransportError(f"the mooncake transport is closed; cannot write to {peer}")
        if self._engine.batch_transfer_sync_write(peer, src, dst, length) != 0:
            raise TransportError(f"raw mooncake batch write of {len(src)} ops to {peer} failed")

    def warm(self, session: str) -> None:
        """Open the peer's segment (a P2P handshake fetches its descriptor): the first write to it
        then takes ~0.2 ms instead of 1-2.5 ms idle (measured; ~10 ms on a loaded host).

        The handshake runs on a daemon thread that the caller waits for at most ``WARM_WAIT_S``
        (a sender's worker thread calls this, and a peer that never answers must not stall its
        other legs); a failure is logged at debug level, never raised: a write reports it."""
        engine = self._engine
        with self._lock:
            if engine is None or session in self._warming:
                return
            self._warming.add(session)
        thread = threading.Thread(
            target=self._handshake, args=(engine, session), name=f"mooncake-warm-{session}", daemon=True
        )
        thread.start()
        thread.join(WARM_WAIT_S)

    def _handshake(self, engine: Any, session: str) -> None:
        """Warm-up thread: open the peer's segment; whatever goes wrong is only logged."""
        try:
            engine.get_first_buffer_address(session)
        except Exception as exc:
            log.debug("mooncake warm-up of %s failed (the first write will report it): %r", session, exc)
        finally:
            with self._lock:
                self._warming.discard(session)

    def register(self, addr: int, length: int) -> None:
        rc = self._engine.register_memory(addr, length)
        if rc != 0:
            raise TransportError(
                f"mooncake register_memory({addr:#x}, {length}) failed with rc {rc} (-7: overlaps a registered region)"
            )
        self._registered.append(addr)

    def submit(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> WriteHandle:
        """The peer's engine checks every destination itself; ``bounds`` are not needed."""
        engine = self._checked(peer, src)
        if not len(src):
            return WriteHandle(peer, 0, DONE)
        handle = WriteHandle(peer, len(src))
        args = (peer, as_ints(src), as_ints(dst), as_ints(length))
        self._collector(peer).put((handle, args, engine.batch_transfer_async_write(*args)))
        return handle

    def submit_wait(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> WriteStatus:
        """``submit`` and its collector's work on this thread: the same batch, the same retry
        and probe, the same statuses; no handle hand-off (the GIL is released while it waits)."""
        engine = self._checked(peer, src)
        if not len(src):
            return DONE
        args = (peer, as_ints(src), as_ints(dst), as_ints(length))
        try:
            return self._outcome(engine, args, engine.batch_transfer_async_write(*args))
        except Exception as exc:  # as the collector: a bug must never read as done
            return WriteStatus(Completion.FAILED, f"mooncake write failed: {exc!r}")

    def _checked(self, peer: str, src: Ops) -> Any:
        """The engine, once a submit of ``src`` is allowed (``TransportError`` otherwise)."""
        if len(src) > self.max_ops_per_submit:
            raise TransportError(
                f"{len(src)} ops in one mooncake submit; split plans into chunks of at most "
                f"{self.max_ops_per_submit} (more can overflow the peer's queue)"
            )
        engine = self._engine
        if engine is None:
            raise TransportError(f"the mooncake transport is closed; cannot write to {peer}")
        return engine

    def _collector(self, peer: str) -> queue.SimpleQueue[_Batch | None]:
        with self._lock:
            if peer not in self._collectors:
                jobs: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
                thread = threading.Thread(target=self._collect, args=(jobs,), name=f"mooncake-{peer}", daemon=True)
                thread.start()
                self._collectors[peer] = (jobs, thread)
            return self._collectors[peer][0]

    def _collect(self, jobs: queue.SimpleQueue[_Batch | None]) -> None:
        """Collector thread: end each handle of one peer, in submission order."""
        engine = self._engine
        while (job := jobs.get()) is not None:
            handle, args, batch = job
            try:
                handle.finish(self._outcome(engine, args, batch))
            except Exception as exc:  # a bug must not leave a handle pending forever
                handle.finish(WriteStatus(Completion.FAILED, f"mooncake collector failed: {exc!r}"))

    @staticmethod
    def _outcome(engine: Any, args: tuple[str, list[int], list[int], list[int]], batch: int) -> WriteStatus:
        """Wait for one batch, retry it once, probe the peer if it failed."""
        rc = engine.get_batch_transfer_status([batch]) if _started(batch) else -1
        if rc != 0:
            batch = engine.batch_transfer_async_write(*args)
            rc = engine.get_batch_transfer_status([batch]) if _started(batch) else -1
        if rc == 0:
            return DONE
        peer = args[0]
        probe = engine.send_probe(peer)
        health = "dead" if probe == PROBE_DEAD else f"answering probes (probe rc {probe})"
        return WriteStatus(
            Completion.FAILED,
            f"mooncake batch write of {len(args[1])} ops ({sum(args[3])} B) to {peer} failed "
            f"with rc {rc} after one retry; the peer is {health}",
        )

    def close(self) -> None:
        if self._engine is None:
            return
        with self._lock:
            collectors, self._collectors = list(self._collectors.values()), {}
        for jobs, _ in collectors:
            jobs.put(None)
        for _, thread in collectors:
            thread.join(CLOSE_WAIT_S)
        for addr in self._registered:
            self._engine.unregister_memory(addr)
        self._registered.clear()
        self._engine = None
