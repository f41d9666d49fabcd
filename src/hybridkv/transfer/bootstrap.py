"""Bootstrap registry: prefill ranks register where to reach them; decode ranks look them up.

A ``BootstrapServer`` is one thread with a zmq ROUTER socket; clients use a DEALER socket
(``bootstrap_call`` for one synchronous exchange, or their own socket in a poll loop).

Invariants:
- A registration is keyed by (engine, pp, tp); its rank must match its layout's ranks.
  Re-registering a rank (a restarted process) replaces the old entry.
- A lookup is ``complete`` only when every (pp, tp) of the engine's sizes is registered
  and all ranks agree on model and sizes; otherwise the reply says what is missing.
- Malformed or unexpected messages get a refusal and are recorded; the server never stops
  on input.
"""

from __future__ import annotations

import logging
import threading

import zmq

from hybridkv.transfer.errors import ProtocolError, TransferError
from hybridkv.transfer.messages import (
    Lookup,
    LookupReply,
    Message,
    Rank,
    Register,
    RegisterAck,
    decode,
    encode,
)

log = logging.getLogger("hybridkv.transfer")


class BootstrapServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._ranks: dict[str, dict[Rank, Register]] = {}
        self.rejected: list[str] = []
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
                try:
                    reply = self.handle(decode(data))
                except TransferError as exc:
                    self._refuse(str(exc))
                    reply = RegisterAck(ok=False, reason=str(exc))
                self._sock.send_multipart([ident, encode(reply)])
        finally:
            self._sock.close(linger=0)

    def _refuse(self, reason: str) -> None:
        log.warning("bootstrap refused a message: %s", reason)
        self.rejected.append(reason)

    def handle(self, msg: Message) -> Message:
        if isinstance(msg, Register):
            b = msg.buffers
            if (msg.rank.pp, msg.rank.tp) != (b.pp_rank, b.tp_rank):
                raise ProtocolError(f"registration of {msg.rank} carries the layout of pp {b.pp_rank} tp {b.tp_rank}")
            self._ranks.setdefault(msg.rank.engine, {})[msg.rank] = msg
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


def bootstrap_call(address: str, msg: Message, timeout_s: float = 5.0) -> Message:
    """One request/reply exchange with a bootstrap server; ``ProtocolError`` on timeout."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(address)
        sock.send(encode(msg))
        if not sock.poll(int(timeout_s * 1000)):
            raise ProtocolError(f"bootstrap {address} did not answer within {timeout_s:.1f} s")
        return decode(sock.recv())
    finally:
        sock.close(linger=0)
