"""The Mooncake Store as a tier: a distributed object store several engine hosts share.

A client (``mooncake.store.MooncakeDistributedStore``) mounts ``segment_bytes`` of this
process's memory into the store and talks to a ``mooncake_master`` (``master.py`` starts one
on loopback for tests; production names an operator's). Metadata goes through the transfer
engine's P2P handshake, so no HTTP metadata server is needed. Facts this module relies on
(probed on ``mooncake-transfer-engine-non-cuda`` 0.3.13, TCP on loopback):
- a full store answers a put with -200 (NO_AVAILABLE_HANDLE) and evicts its oldest keys on
  its own, so a key seen with ``exists`` may be gone when read: a load is checked, and a
  missing object is a miss (``EVICTED`` once the caller planned on it), never garbage;
- ``remove`` of a fresh object answers -706 (OBJECT_HAS_LEASE, a 10 s read lease): evict
  and corrupt-object removal use ``force``;
- a killed master makes every call answer -900 at once; a stopped (hung) one makes calls
  wait ``MC_RPC_TIMEOUT_MS`` (-901; set here to ``rpc_timeout_ms``, default 2 s) instead of
  30 s; a restarted master is found again by the same client (its segment remounted about
  a second later; puts meanwhile answer -200), with the old objects gone;
- a client's ``close`` joins its ping thread holding the GIL (1-2 s); ``unmount_and_free_segment``
  of a segment mounted with ``allocate_and_mount_segment`` takes it and its objects out of the
  store at once: ``close`` does that and pools the client (``mooncake_clients``);
- ``setup`` without a master retries ``MC_STORE_CLIENT_SETUP_RETRIES`` times (set to 1: it
  fails in ~4 s instead of a minute);
- the client's own handshake and TCP data listeners bind every interface whatever
  ``local_hostname`` or ``MC_TCP_BIND_ADDRESS`` say (checked with ``ss``): this library's
  limit, not a choice made here; the master binds loopback only.

Every call runs on one worker thread, in submission order. The tier is *down* once a call
answers -900/-901, a client cannot be set up, or a caller's ``wait`` times out: from then
on every operation is answered at once (``DOWN`` misses, all-False ``exists``) without
touching the worker, and every ``retry_s`` one probe (``exists`` of a probe key, or a new
``setup`` when the client never came up) runs when the worker is idle; the first probe the
master answers brings the tier back up.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import numpy as np
import torch

from hybridkv.native_log import init_log
from hybridkv.tiers.base import PutStatus, StorageTier, Ticket, TierError, TierTimeout
from hybridkv.tiers.framing import MissReason, write_header
from hybridkv.tiers.mooncake_clients import give as pool_client
from hybridkv.tiers.mooncake_clients import take as pooled_client

T = TypeVar("T")

FULL = -200
"""NO_AVAILABLE_HANDLE: no room for the object; the store evicts its oldest keys meanwhile."""
NOT_FOUND = -704
HAS_LEASE = -706
TOO_SMALL = -600
"""The reader's buffer is smaller than the object (also: a client that is not set up)."""
UNREACHABLE = -900
NO_ANSWER = -901
_DOWN_CODES = frozenset((UNREACHABLE, NO_ANSWER))
PROBE_KEY = "hybridkv/probe"
MIN_SEGMENT = 16 << 20
ENV_DEFAULTS = {"MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}


class MooncakeStoreTier(StorageTier):
    name = "mooncake"

    def __init__(
        self,
        master: str,
        *,
        segment_bytes: int = 256 << 20,
        local_buffer_bytes: int = 16 << 20,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        rpc_timeout_ms: int = 2000,
        retry_s: float = 1.0,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 15.0,
    ):
        super().__init__()
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise TierError(f"Mooncake master address must be host:port, got {master!r}")
        if segment_bytes < MIN_SEGMENT or local_buffer_bytes < MIN_SEGMENT:
            raise TierError(
                f"Mooncake Store segment_bytes and local_buffer_bytes must be at least {MIN_SEGMENT} B (16 MiB; the "
                f"client refuses less), got {segment_bytes} and {local_buffer_bytes}"
            )
        for key, value in ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        os.environ["MC_RPC_TIMEOUT_MS"] = str(int(rpc_timeout_ms))
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise TierError(
                f"the Mooncake Store needs the 'mooncake' extra (pip install hybridkv[mooncake]): {exc}"
            ) from None
        self._factory = MooncakeDistributedStore
        self.master = master
        self.segment_bytes = segment_bytes
        self.local_buffer_bytes = local_buffer_bytes
        self.local_hostname = local_hostname
        self.protocol = protocol
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self._store: Any = None
        self._segments: list[str] = []
        self._client_key = (master, local_hostname, protocol, local_buffer_bytes)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridkv-store")
        self._lock = threading.Lock()
        self._down = False
        self._next_probe = 0.0
        self._inflight = 0
        self._closed = False
        try:
            connected = self._submit(self._connect).wait(connect_timeout_s)
        except TierTimeout:
            connected = False
        if not connected:
            self.close()
            raise TierError(
                f"cannot set up a Mooncake Store client against master {master} (is mooncake_master running "
                "there? python -m hybridkv.tiers starts one on loopback)"
            )

    # --- health ---------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return not self._down

    def _mark_down(self) -> None:
        with self._lock:
            if not self._down:
                self._down = True
                self.stats.down_events += 1
            self._next_probe = time.monotonic() + self.retry_s

    def _connect(self) -> bool:
        store = pooled_client(self._client_key)
        if store is None:
            store = self._factory()
            # no segment from ``setup``: it is mounted apart, so that ``close`` can unmount it by id
            with init_log():  # its embedded transfer engine's harmless start-up lines are dropped (native_log)
                rc = store.setup(
                    self.local_hostname, "P2PHANDSHAKE", 0, self.local_buffer_bytes, self.protocol, "", self.master
                )
            if rc != 0:
                store.close()
                self._mark_down()
                return False
        mounted = store.allocate_and_mount_segment(self.segment_bytes, self.protocol, "")
        if mounted.get("ret") != 0:
            store.close()
            self._mark_down()
            return False
        self._store, self._segments = store, list(mounted["segment_ids"])
        with self._lock:
            self._down = False
        return True

    def _release(self, store: Any) -> None:
        """Unmount this tier's segment (its objects leave the store) and pool the client for the next
        tier (``mooncake_clients``); a client that cannot unmount is closed."""
        if not self._down and store.unmount_and_free_segment(self._segments, 0) == 0:
            pool_client(self._client_key, store)
        else:
            store.close()

    def _probe(self) -> None:
        if self._store is None:
            self._connect()
            return
        codes = self._store.batch_is_exist([PROBE_KEY])
        if codes and codes[0] >= 0:
            with self._lock:
                self._down = False
        else:
            self._mark_down()

    # --- running calls --------------------------------------------------------------------

    def _submit(self, call: Callable[[], T]) -> Ticket[T]:
        with self._lock:
            self._inflight += 1
        future = self._worker.submit(self._counted, call)
        return Ticket(future, on_timeout=self._mark_down)

    def _counted(self, call: Callable[[], T]) -> T:
        try:
            return call()
        finally:
            with self._lock:
                self._inflight -= 1

    def _run(self, call: Callable[[], T], down: Callable[[], T]) -> Ticket[T]:
        if self._closed:
            raise TierError("the Mooncake Store tier is closed")
        if self._down:
            with self._lock:
                due = self._inflight == 0 and time.monotonic() >= self._next_probe
                if due:
                    self._next_probe = time.monotonic() + self.retry_s
            if due:
                self._submit(self._probe)
            return Ticket.done(down())
        return self._submit(lambda: call() if not self._down else down())

    def _saw(self, codes: list[int]) -> None:
        if any(c in _DOWN_CODES for c in codes):
            self._mark_down()

    # --- the backend ----------------------------------------------------------------------

    def _write(self, keys: list[str], frames: list[torch.Tensor], label: str) -> list[PutStatus]:
        bufs = [_materialize(k, f) for k, f in zip(keys, frames, strict=True)]
        codes = list(self._store.batch_put_from(keys, [b.data_ptr() for b in bufs], [b.numel() for b in bufs]))
        self._saw(codes)
        return [_put_status(c) for c in codes]

    def _read(self, keys: list[str], frame_bytes: list[int]) -> list[torch.Tensor | MissReason]:
        staging = torch.empty(sum(frame_bytes), dtype=torch.uint8)
        views, at = [], 0
        for n in frame_bytes:
            views.append(staging[at : at + n])
            at += n
        codes = list(self._store.batch_get_into(keys, [v.data_ptr() for v in views], frame_bytes))
        self._saw(codes)
        out: list[torch.Tensor | MissReason] = []
        for view, n, code in zip(views, frame_bytes, codes, strict=True):
            if code == n:
                out.append(view)
            elif code >= 0 or code == TOO_SMALL:
                out.append(MissReason.SIZE)
            elif code == NOT_FOUND:
                out.append(MissReason.ABSENT)
            elif code in _DOWN_CODES:
                out.append(MissReason.DOWN)
            else:
                out.append(MissReason.ERROR)
        return out

    def _exists(self, keys: list[str]) -> np.ndarray:
        codes = list(self._store.batch_is_exist(keys))
        self._saw(codes)
        return np.asarray([c == 1 for c in codes], dtype=bool)

    def _remove(self, keys: list[str]) -> int:
        codes = list(self._store.batch_remove(keys, True))
        self._saw(codes)
        return sum(1 for c in codes if c == 0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        store, self._store = self._store, None
        if store is not None and self._inflight == 0:  # a worker stuck in a call keeps the client
            with contextlib.suppress(FutureTimeout):
                self._worker.submit(self._release, store).result(timeout=self.timeout_s)
        self._worker.shutdown(wait=False, cancel_futures=True)


def _put_status(code: int) -> PutStatus:
    if code == 0:
        return PutStatus.STORED
    if code == FULL:
        return PutStatus.REFUSED
    if code in _DOWN_CODES:
        return PutStatus.DOWN
    return PutStatus.ERROR


def _materialize(key: str, frame: torch.Tensor) -> torch.Tensor:
    """A replay's meta frame becomes real bytes (a zero payload with its header): the store
    holds objects of the true size."""
    if frame.device.type != "meta":
        return frame.contiguous()
    return write_header(torch.zeros(frame.numel(), dtype=torch.uint8), key)
