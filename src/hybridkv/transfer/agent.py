"""Agent: the control-plane thread and the worker thread behind every transfer rank.

Construction (one ``Agent.__init__`` for ``PrefillSender`` and ``DecodeReceiver``): a rank of
``engine`` over one ``UnifiedMemory`` (its shard names the rank, its layout is ``buffers``),
reached through one bootstrap and one transport; the subclass adds its own state and calls
``_start``. A transport that cannot move the memory's device, or a memory without a transfer
layout, is refused, and the memory is registered with the transport, before any socket or
address exists.

Threads and ownership:
- The *owner* (the engine's thread) calls the public methods of ``PrefillSender`` and
  ``DecodeReceiver``; only it touches ``UnifiedMemory`` (alloc, free, pin, release).
- The *I/O thread* owns every zmq socket and every request record. It receives messages,
  runs closures the other threads post with ``call_soon``, checks timers (``tick``), and
  reports finished requests to the owner through ``events``.
- The *worker thread* runs slow jobs (plans, byte copies, checksums) so heartbeats keep
  flowing; it reports back with ``call_soon``; messages go out with ``post``.

Invariants:
- Every frame is opened by ``auth.Gate`` before anything reads it: no valid MAC, a
  replay, another addressee, or a message whose ``rank`` is not the frame's sender is
  refused (logged, counted in ``auth_failures`` / ``rejected``) and changes no state.
  Every frame sent is sealed with this agent's rank, epoch and next sequence number.
- A message that does not decode, or that a handler refuses, is logged and recorded in
  ``rejected``; no input ever stops the I/O thread (handler exceptions are caught).
- Sends never block: a peer that does not drain its socket loses messages, which the
  request timeouts turn into failures.
- ``close`` stops both threads and closes every socket within its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from functools import partial
from typing import TypedDict

import zmq

from hybridkv.memory import UnifiedMemory
from hybridkv.transfer.auth import AuthError, ClusterKey, Gate, Seal, load_cluster_key
from hybridkv.transfer.buffers import buffer_set_from_memory
from hybridkv.transfer.errors import ProtocolError, TransferError
from hybridkv.transfer.messages import Message, Rank
from hybridkv.transfer.status import ReportBoard, StatusReport
from hybridkv.transfer.transport import Transport

log = logging.getLogger("hybridkv.transfer")


_ENDPOINT = re.compile(r"tcp://[0-9A-Za-z.\-\[\]:]+:[0-9]{1,5}")


def check_endpoint(endpoint: str) -> None:
    """Refuse a peer endpoint that is not ``tcp://host:port`` (no ipc:// files, no options)."""
    if not _ENDPOINT.fullmatch(endpoint):
        raise ProtocolError(f"endpoint {endpoint!r} is not tcp://host:port")


class EventKind(Enum):
    """What the I/O thread tells the owner about a request."""

    DONE = "done"  # finished: the payload is its final StatusReport
    KEEP = "keep"  # (decode) succeeded: unpin its pages, they are the owner's now
    RELEASE = "release"  # (decode) failed and quiet: unpin its pages and hand them back to the owner


Event = tuple[EventKind, str, object]  # (kind, request id, payload) for the owner


class AgentOptions(TypedDict, total=False):
    """The keyword options of ``Agent.__init__`` (defaults there), passed through by the agents."""

    host: str
    timeout_s: float
    heartbeat_s: float
    peer_timeout_s: float
    key: ClusterKey | None


class Agent:
    tick_s = 0.02

    def __init__(
        self,
        mem: UnifiedMemory,
        engine: str,
        bootstrap: str,
        transport: Transport,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        heartbeat_s: float = 0.5,
        peer_timeout_s: float = 5.0,
        key: ClusterKey | None = None,
    ) -> None:
        """``bootstrap``: the bootstrap server's address; ``host``: where this rank listens;
        ``timeout_s``: a request's deadline; ``heartbeat_s``: how often peers of requests in flight
        are told this rank is alive; ``peer_timeout_s``: how long such a peer may stay silent;
        ``key``: the cluster key (default: ``auth.load_cluster_key()``, from the environment)."""
        transport.check_device(mem.device.type)
        self.buffers = buffer_set_from_memory(mem)
        transport.register(mem.arena.buffer.data_ptr(), mem.arena.nbytes)
        self.mem = mem
        self.transport = transport
        self.bootstrap = bootstrap
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self._last_heartbeat = 0.0  # I/O thread only
        self._reports = ReportBoard()  # the latest report per request, for ``status`` (thread-safe)
        self.rank = rank = Rank(engine, mem.shard.pp_rank, mem.shard.tp_rank)
        key = load_cluster_key() if key is None else key
        self.seal = Seal(key, rank)
        self.gate = Gate(key)
        self.auth_failures = 0
        self.rejected: deque[str] = deque(maxlen=1000)
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.linger = 0
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        wake = f"inproc://wake-{id(self)}"
        self._wake_in = self._ctx.socket(zmq.PULL)
        self._wake_in.bind(wake)
        self._wake_out = self._ctx.socket(zmq.PUSH)
        self._wake_out.linger = 0
        self._wake_out.connect(wake)
        self._wake_lock = threading.Lock()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._wake_in, zmq.POLLIN)
        self._io = threading.Thread(target=self._run_io, name=f"{rank}-io", daemon=True)
        self._worker = threading.Thread(target=self._run_jobs, name=f"{rank}-work", daemon=True)
        self._closed = False

    def status(self, request_id: str) -> StatusReport | None:
        """The latest report of ``request_id`` on this rank (None: never seen, or long forgotten)."""
        return self._reports.get(request_id)

    # --- subclass hooks ---------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.seal.epoch

    def on_message(self, msg: Message, epoch: int) -> None:
        """``msg`` from ``msg.rank`` (its sender, authenticated) at the sender's ``epoch``."""
        raise NotImplementedError

    def on_socket(self, sock: zmq.Socket) -> None:
        """A socket a subclass registered with ``self._poller`` is readable."""
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Timers: deadlines, heartbeats, retries."""

    # --- plumbing ---------------------------------------------------------------------

    def _start(self) -> None:
        self._io.start()
        self._worker.start()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread (from any thread)."""
        self._calls.put(fn)
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(zmq.Again):  # Again: a wake is pending
            if not self._closed:
                self._wake_out.send(b"", zmq.NOBLOCK)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker thread."""
        self._jobs.put(job)

    def post(self, endpoint: str, msg: Message) -> bool:
        """Queue ``msg`` to ``endpoint`` without blocking (I/O thread only)."""
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.sndhwm = 10000
            sock.connect(endpoint)
            self._push[endpoint] = sock
        try:
            sock.send(self.seal.seal(endpoint, msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("%s: %s is not draining its socket; dropped %s", self.rank, endpoint, type(msg).__name__)
            return False

    def reject(self, reason: str) -> None:
        log.warning("%s rejected a message: %s", self.rank, reason)
        self.rejected.append(reason)

    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except AuthError as exc:
            self.auth_failures += 1
            self.reject(f"{what}: {exc}")
        except TransferError as exc:
            self.reject(f"{what}: {exc}")
        except Exception as exc:  # a bug must not kill the I/O thread
            log.exception("%s: %s failed", self.rank, what)
            self.reject(f"{what}: internal error {exc!r}")

    def _run_io(self) -> None:
        try:
            while not self._stopping.is_set():
                ready = dict(self._poller.poll(int(self.tick_s * 1000)))
                if self._pull in ready:
                    self._drain_messages()
                if self._wake_in in ready:
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                for sock in ready:
                    if sock is not self._pull and sock is not self._wake_in:
                        self._guard("socket", partial(self.on_socket, sock))
                while not self._calls.empty():
                    self._guard("call", self._calls.get())
                self._guard("tick", lambda: self.tick(time.monotonic()))
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        """Close every socket the I/O thread owns (subclasses add theirs)."""
        for sock in [self._pull, self._wake_in, *self._push.values()]:
            sock.close(linger=0)

    def _drain_messages(self) -> None:
        for _ in range(1000):
            try:
                data = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._guard("message", partial(self._on_bytes, data))

    def _on_bytes(self, data: bytes) -> None:
        env = self.gate.open(data, self.endpoint)
        claimed = getattr(env.body, "rank", env.sender)
        if claimed != env.sender:
            raise AuthError(f"{type(env.body).__name__} claims to come from {claimed}, its frame from {env.sender}")
        self.on_message(env.body, env.epoch)

    def _run_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # jobs report their own errors; this is a bug
                log.exception("%s: worker job failed", self.rank)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop both threads and close every socket."""
        if self._closed:
            return
        self._stopping.set()
        self._wake()
        with self._wake_lock:
            self._closed = True
            self._wake_out.close(linger=0)
        if self._io.ident is None:  # never started: the sockets are still ours to close
            self._close_sockets()
        else:
            self._io.join(timeout_s)
            self._jobs.put(None)
            self._worker.join(timeout_s)
        if self._io.is_alive() or self._worker.is_alive():
            log.error("%s: threads did not stop within %.1f s", self.rank, timeout_s)
            return
        self._ctx.term()
