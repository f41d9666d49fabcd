"""Fault drills: a real transport with one behaviour changed (the PD server's deliberate faults, tests, demos).

Invariant: a wrapper forwards everything it does not change to ``inner`` (so it names,
registers, addresses, warms, stages and ends handles exactly as the real transport does):
every class attribute ``Transport`` declares and every method it defines except those made
of other methods (``create``, ``check_device``, ``write``, ``submit_wait``: the base's, made of
the wrapper's ``submit`` and ``wait``, so a drill's change applies to it too); a test holds
``Delegating`` to it.
"""

from __future__ import annotations

import time

from hybridkv.transfer.ops import Bounds, Ops
from hybridkv.transfer.transport import Transport, WriteHandle, WriteStatus


class Delegating(Transport):
    """A transport that forwards everything to ``inner``; subclasses change one behaviour."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        for attr in Transport.__annotations__:  # the class attributes (name, pays_per_op, ...), any added later too
            setattr(self, attr, getattr(inner, attr))

    @property
    def session(self) -> str:
        return self.inner.session

    def check_session(self, session: str) -> None:
        self.inner.check_session(session)

    def register(self, addr: int, length: int) -> None:
        self.inner.register(addr, length)

    def submit(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> WriteHandle:
        return self.inner.submit(peer, src, dst, length, bounds)

    def warm(self, session: str) -> None:
        self.inner.warm(session)

    def raw_write(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> None:
        self.inner.raw_write(peer, src, dst, length)

    def poll(self, handle: WriteHandle) -> WriteStatus:
        return self.inner.poll(handle)

    def wait(self, handle: WriteHandle, timeout_s: float | None) -> WriteStatus:
        return self.inner.wait(handle, timeout_s)

    def close(self) -> None:
        self.inner.close()


class Throttled(Delegating):
    """A real transport that sleeps before every submit (a slow or hung peer)."""

    def __init__(self, inner: Transport, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def submit(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> WriteHandle:
        time.sleep(self.delay_s)
        return super().submit(peer, src, dst, length, bounds)
