"""The rigs' owner of the memory transfer agents move (pd-demo, stage worker, tests; ``bench
transfer`` reserves and pins the same way inline, as product code never imports this package).

Transfer agents are handed memory, always: a ``DecodeReceiver`` writes into pages and a state
slot its owner reserved, a ``PrefillSender`` reads pages its owner pinned; neither allocates,
frees, or releases the owner's pin. In the engine the owner is ``KVManager``; in the rigs it is
this module, with the same one free path on each side:
- decode: ``Reservations.request`` reserves what ``seq_len`` tokens need (``reserve``: pages, and
  a state slot when the memory has state pools) and asks for it. A request that succeeded is the
  rig's to read and ``free``; one that failed is freed by ``collect`` when the receiver hands it
  back (``take_releasable``: no writer can touch it any more), never earlier.
- prefill: ``send`` pins what it hands to the sender; the rig releases the returned gate once the
  sender's ``poll`` reported the request finished.

Invariant: a call here that raises leaves nothing reserved and nothing pinned.
"""

from __future__ import annotations

import time

import numpy as np

from hybridkv.memory import MoveGate, UnifiedMemory
from hybridkv.transfer.decode import DecodeReceiver
from hybridkv.transfer.incoming import Allocation
from hybridkv.transfer.plan import num_pages
from hybridkv.transfer.prefill import PrefillSender
from hybridkv.transfer.status import StatusReport


def reserve(mem: UnifiedMemory, seq_len: int) -> Allocation:
    """The pages ``seq_len`` tokens need, and a state slot when ``mem`` has state pools."""
    pages = mem.alloc_pages(num_pages(seq_len, mem.page_size))
    if not mem.slot_pools:
        return Allocation(pages, None)
    try:
        return Allocation(pages, int(mem.alloc_state(1)[0]))
    except BaseException:
        mem.free_pages(pages)
        raise


def free(mem: UnifiedMemory, alloc: Allocation) -> None:
    mem.free_pages(alloc.pages)
    if alloc.slot is not None:
        mem.free_state([alloc.slot])


class Reservations:
    """What a rig reserved on one decode rank, by request id."""

    def __init__(self, receiver: DecodeReceiver) -> None:
        self.receiver = receiver
        self.held: dict[str, Allocation] = {}

    def request(self, request_id: str, engine: str, seq_len: int, checksum: bool | None = None) -> Allocation:
        """Reserve for ``seq_len`` tokens and ask ``engine`` for them (``DecodeReceiver.request``)."""
        alloc = reserve(self.receiver.mem, seq_len)
        try:
            self.receiver.request(request_id, engine, seq_len, reserved=alloc, checksum=checksum)
        except BaseException:
            free(self.receiver.mem, alloc)
            raise
        self.held[request_id] = alloc
        return alloc

    def free(self, request_id: str) -> None:
        free(self.receiver.mem, self.held.pop(request_id))

    def collect(self) -> list[StatusReport]:
        """The receiver's ``poll``; then frees every failed request it handed back."""
        reports = self.receiver.poll()
        for request_id in self.receiver.take_releasable():
            self.free(request_id)
        return reports

    def settle(self, timeout_s: float) -> int:
        """``collect`` until the receiver holds no request's pages (every quarantine over, what it
        handed back freed) or ``timeout_s`` passed; how many requests it still holds."""
        end = time.monotonic() + timeout_s
        while True:
            self.collect()
            if not self.receiver.held or time.monotonic() > end:
                return self.receiver.held
            time.sleep(0.005)


def send(sender: PrefillSender, request_id: str, pages: np.ndarray, slot: int | None, seq_len: int) -> MoveGate:
    """Pin ``pages`` and ``slot`` and hand them over (``PrefillSender.send``); release the gate
    returned once ``sender.poll`` reported the request."""
    gate = sender.mem.pin(pages=pages, slots=None if slot is None else [slot])
    try:
        sender.send(request_id, pages, slot, seq_len, pinned=gate)
    except BaseException:
        gate.release()
        raise
    return gate
