"""A scripted peer for the fault and security tests: it can send anything, signed or not."""

from __future__ import annotations

import time

import zmq

from hybridkv.transfer.auth import ClusterKey, Gate, Seal
from hybridkv.transfer.messages import Message, Process, Rank, Register


class Wire:
    """Messages to ``endpoint`` arrive here; ``send`` signs with ``key`` as the message's rank
    (one ``Seal``, so one epoch, per rank), unless given raw bytes or ``key=None``."""

    def __init__(self, key: ClusterKey | None) -> None:
        self.key = key
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.linger = 0
        self.endpoint = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.push: dict[str, zmq.Socket] = {}
        self.seals: dict[Rank, Seal] = {}
        self.gate = Gate(key) if key is not None else None

    def seal(self, rank: Rank) -> Seal:
        """The seal this wire signs ``rank``'s messages with (created on first use)."""
        assert self.key is not None, "a wire without a key signs nothing"
        if rank not in self.seals:
            self.seals[rank] = Seal(self.key, rank)
        return self.seals[rank]

    def frame(self, endpoint: str, msg: Message, sender: Rank | None = None) -> bytes:
        sender = sender or msg.rank  # type: ignore[union-attr]
        return self.seal(sender).seal(endpoint, msg)

    def send(self, endpoint: str, msg: Message | bytes, sender: Rank | None = None) -> None:
        if endpoint not in self.push:
            self.push[endpoint] = self.ctx.socket(zmq.PUSH)
            self.push[endpoint].linger = 0
            self.push[endpoint].connect(endpoint)
        self.push[endpoint].send(msg if isinstance(msg, bytes) else self.frame(endpoint, msg, sender))

    def recv(self, kind: type, timeout_s: float = 5.0) -> Message:
        assert self.gate is not None
        end = time.monotonic() + timeout_s
        while self.pull.poll(max(1, int((end - time.monotonic()) * 1000))):
            msg = self.gate.open(self.pull.recv(), self.endpoint).body
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def register(self, rank: Rank, **fields: object) -> Register:
        """A registration of ``rank`` at this wire's endpoint, in its seal's epoch (no process:
        a writer nobody can prove gone)."""
        base: dict[str, object] = {
            "rank": rank,
            "endpoint": self.endpoint,
            "transport": "shm",
            "session": "",
            "epoch": self.seal(rank).epoch,
            "process": Process("", 0, 0),
        }
        return Register(**{**base, **fields})  # type: ignore[arg-type]

    def close(self) -> None:
        for sock in [self.pull, *self.push.values()]:
            sock.close(linger=0)
        self.ctx.term()
