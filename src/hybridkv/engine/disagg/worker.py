"""Worker: what every process of a disaggregated engine does alike, around its ``Scheduler``.

A worker is one rank of an engine's ``torch.distributed`` world (the prefill engine: PP x TP
ranks; the decode engine: TP ranks). World rank 0 alone reads the router's commands from its
pipe; at every step boundary it broadcasts what it read to every rank, so every rank applies
the same commands at the same step and its scheduler (whose memory-dependent decisions go
through a ``WorldAgreement``) runs the same schedule. The loop: read commands, apply them, run
one ``tick`` (a scheduler step and the transfer agent's progress), until ``Stop``; then
``drain`` (bounded), ``mem.verify()`` and a ``Report`` of the live pages and slots before and
after.

Invariants:
- An idle leader still broadcasts every ``IDLE_S`` seconds, well inside the collective timeout,
  so an idle engine never times out; a busy one polls its pipe without waiting.
- Every rank answers a ``Probe`` with ``Live``: what it holds now outside its prefix cache.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from hybridkv.engine.disagg.config import WorkerArgs
from hybridkv.engine.disagg.protocol import Command, Live, Probe, Ready, Report, Stop
from hybridkv.engine.sched.agreement import ALONE, Agreement, WorldAgreement
from hybridkv.engine.sched.kv import RequestKV
from hybridkv.engine.sched.request import Request, SamplingParams
from hybridkv.engine.sched.scheduler import Role, Scheduler
from hybridkv.memory import UnifiedMemory

IDLE_S = 0.05


def live(mem: UnifiedMemory) -> tuple[int, int]:
    """(pages, slots) live in ``mem``."""
    return int(mem.pages.capacity - mem.pages.free_count), int(mem.slots.capacity - mem.slots.free_count)


class Worker:
    role: Role
    mem: UnifiedMemory
    kv: RequestKV
    sched: Scheduler

    def __init__(self, rank: int, conn: Connection, args: WorkerArgs, size: int) -> None:
        self.rank, self.conn, self.args, self.size = rank, conn, args, size
        self.agree: Agreement = WorldAgreement(dist.group.WORLD, size) if size > 1 else ALONE
        self.eos: frozenset[int] = frozenset()
        self.nbytes = 0
        self.requests = 0

    def scheduler(self) -> Scheduler:
        e = self.args.config.engine
        return Scheduler(self.kv, e.chunk_size, e.max_running, e.step_tokens, self.role, self.agree)

    def request(self, tid: str, ids: tuple[int, ...], params: SamplingParams) -> Request:
        return Request(tid, list(ids), params, params.stops(self.eos))

    # --- the loop -------------------------------------------------------------------------

    def serve(self, shm_path: str = "") -> None:
        self.before = live(self.mem)
        self.conn.send(Ready(os.getpid(), shm_path, self.before))
        while True:
            commands = self.commands()
            if any(isinstance(c, Stop) for c in commands):
                break
            for command in commands:
                if isinstance(command, Probe):
                    self.conn.send(Live(command.seq, self.held_live(), self.held_requests(), torch.get_num_threads()))
                else:
                    self.apply(command)
            self.tick()
        self.drain()
        self.mem.verify()
        self.conn.send(Report(self.before, live(self.mem), self.nbytes, self.requests))

    def commands(self) -> list[Command]:
        """What the leader read since the last step, on every rank."""
        out: list[Command] = []
        if self.rank == 0 and self.conn.poll(self.poll_s()):
            while self.conn.poll(0):
                out.append(self.conn.recv())
        if self.size == 1:
            return out
        box: list[object] = [out]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    # --- what each role defines --------------------------------------------------------------

    def poll_s(self) -> float:
        """How long the leader may wait for a command: 0 with steps to run, a moment while only
        transfers are in flight, ``IDLE_S`` when idle."""
        sched = self.sched
        if sched.has_work():
            return 0.0
        return 0.002 if sched.held() else IDLE_S

    def apply(self, command: Command) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        raise NotImplementedError

    def held_live(self) -> tuple[int, int]:
        """(pages, slots) live now outside the prefix cache."""
        return live(self.mem)

    def held_requests(self) -> int:
        raise NotImplementedError
