"""Bootstrap registry: prefill ranks register where to reach them; decode ranks look them up.

A ``BootstrapServer`` is one thread with a zmq ROUTER socket; clients use a DEALER socket
(``bootstrap_call`` for one synchronous exchange, or their own socket in a poll loop).

Every request and reply is an authenticated frame (``hybridkv.transfer.auth``); a reply is
addressed to the exact request it answers (``reply_address``), so an old reply cannot be
replayed as the answer to a new request.

Invariants:
- A registration is keyed by (engine, pp, tp); its rank must match its layout's ranks and
  the frame's sender, its epoch the frame's epoch. A registered rank is replaced only by a
  registration with a newer epoch (a restarted process); the same epoch again is accepted
  only when it says exactly the same; anything else is refused with a log line.
- A lookup is ``complete`` only when every (pp, tp) of the engine's sizes is registered
  and all ranks agree on model and sizes; otherwise the reply says what is missing.
- Malformed or unexpected messages get a refusal and are recorded; the server never stops
  on input. What a refused peer costs is bounded (``transfer.refusals``): the last
  ``REFUSALS_KEPT`` reasons in ``rejected``, every refusal counted in ``refused``, the log
  rate-limited with a count of the lines it left out.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import zmq

from hybridkv.transfer.auth import AuthError, ClusterKey, Envelope, Gate, Seal, load_cluster_key
from hybridkv.transfer.errors import ProtocolError, TransferError
from hybridkv.transfer.messages import Lookup, LookupReply, Message, Rank, Register, RegisterAck
from hybridkv.transfer.refusals import Refusals

BOOTSTRAP_RANK = Rank("bootstrap", 0, 0)
BOOTSTRAP_ADDRESSEE = "bootstrap"
"""What requests to a bootstrap are addressed to: its name, not its address (clients may
reach it under another host name than the one it bound)."""


def reply_address(env: Envelope) -> str:
    """Where the answer to the request in ``env`` is addressed: its sender, epoch and sequence."""
    return f"{env.sender}@{env.epoch}#{env.seq}"


def reply_prefix(seal: Seal) -> str:
    """What every reply to a request sealed by ``seal`` is addressed to, up to the sequence."""
    return f"{seal.sender}@{seal.epoch}#"


log = logging.getLogger("hybridkv.transfer")
REFUSALS_KEPT = 1000


class BootstrapServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, key: ClusterKey | None = None) -> None:
        key = load_cluster_key() if key is None else key
        self._seal = Seal(key, BOOTSTRAP_RANK)
        self._gate = Gate(key)
        self.auth_failures = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._ranks: dict[str, dict[Rank, Register]] = {}
        self._refusals = Refusals(log, "bootstrap", keep=REFUSALS_KEPT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="bootstrap", daemon=True)

    def start(self) -> BootstrapServer:
        self._thread.start()
        return self

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(50):
                    continue
                frames = self._sock.recv_multipart()
                if len(frames) != 2:
                    self._refuse(f"{len(frames)} frames (want identity + message)")
                    continue
                ident, data = frames
                to = ""  # a refusal of a frame that did not open is addressed to nobody in particular
                try:
                    env = self._gate.open(data, BOOTSTRAP_ADDRESSEE)
                    to = reply_address(env)
                    reply = self.handle(env)
                except TransferError as exc:
                    self.auth_failures += isinstance(exc, AuthError)
                    self._refuse(str(exc))
                    reply = RegisterAck(ok=False, reason=str(exc))
                self._sock.send_multipart([ident, self._seal.seal(to, reply)])
        finally:
            self._sock.close(linger=0)

    @property
    def rejected(self) -> deque[str]:
        """The reasons of the last ``REFUSALS_KEPT`` refused messages, oldest first."""
        return self._refusals.recent

    @property
    def refused(self) -> int:
        """Every message refused so far (auth failures included)."""
        return self._refusals.count

    def _refuse(self, reason: str) -> None:
        self._refusals.add(reason)

    def handle(self, env: Envelope) -> Message:
        msg = env.body
        if isinstance(msg, Register):
            b = msg.buffers
            if msg.rank != env.sender or msg.epoch != env.epoch:
                raise AuthError(
                    f"registration of {msg.rank} (epoch {msg.epoch}) sent by {env.sender} (epoch {env.epoch})"
                )
            if (msg.rank.pp, msg.rank.tp) != (b.pp_rank, b.tp_rank):
                raise ProtocolError(f"registration of {msg.rank} carries the layout of pp {b.pp_rank} tp {b.tp_rank}")
            ranks = self._ranks.setdefault(msg.rank.engine, {})
            old = ranks.get(msg.rank)
            if old is not None and (msg.epoch < old.epoch or (msg.epoch == old.epoch and msg != old)):
                raise ProtocolError(
                    f"{msg.rank} is registered by epoch {old.epoch} at {old.endpoint}; a registration from "
                    f"epoch {msg.epoch} cannot replace it (a restarted rank registers with a newer epoch)"
                )
            ranks[msg.rank] = msg
            return RegisterAck(ok=True, reason="")
        if isinstance(msg, Lookup):
            return self.lookup(msg.engine)
        raise ProtocolError(f"bootstrap does not handle {type(msg).__name__} messages")

    def lookup(self, engine: str) -> LookupReply:
        ranks = tuple(sorted(self._ranks.get(engine, {}).values(), key=lambda r: (r.rank.pp, r.rank.tp)))
        if not ranks:
            return LookupReply(engine, (), False, f"no rank of engine {engine!r} registered yet")
        first = ranks[0].buffers
        sizes = {(r.buffers.model, r.buffers.pp_size, r.buffers.tp_size) for r in ranks}
        if len(sizes) > 1:
            return LookupReply(engine, ranks, False, f"ranks disagree on model/sizes: {sorted(sizes)}")
        want = first.pp_size * first.tp_size
        if len(ranks) < want:
            return LookupReply(engine, ranks, False, f"{len(ranks)} of {want} ranks registered")
        return LookupReply(engine, ranks, True, "")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._ctx.term()
        self._refusals.flush()


def bootstrap_call(address: str, msg: Message, seal: Seal, timeout_s: float = 5.0) -> Message:
    """One request/reply exchange with a bootstrap server; ``ProtocolError`` on timeout or
    an answer that is not the authenticated reply to this request."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    seq, frame = seal.frame(BOOTSTRAP_ADDRESSEE, msg)
    to = reply_prefix(seal) + str(seq)
    try:
        sock.connect(address)
        sock.send(frame)
        if not sock.poll(int(timeout_s * 1000)):
            raise ProtocolError(f"bootstrap {address} did not answer within {timeout_s:.1f} s")
        data = sock.recv()
    finally:
        sock.close(linger=0)
    try:
        env = Gate(seal.key).open(data, lambda addressee: addressee in (to, ""))
    except AuthError as exc:
        raise AuthError(f"bootstrap {address}: {exc}; do both sides use the same cluster key?") from None
    # An unaddressed frame is only ever a refusal of a frame that did not open: a replayed one can
    # refuse (like dropped traffic), never accept or answer a lookup.
    unaddressed_refusal = isinstance(env.body, RegisterAck) and not env.body.ok
    if env.sender != BOOTSTRAP_RANK or (not env.to and not unaddressed_refusal):
        raise AuthError(f"bootstrap {address} answered as {env.sender} with {type(env.body).__name__}")
    return env.body
