"""One prefill rank in its own process (started by ``hybridkv.testing.harness.StageProcess``).

``python -m hybridkv.testing.stage_worker '<json config>'`` (see ``harness.stage_config``):
builds the rank's memory, fills each request's pages and state slot with the byte
``pattern``, registers a ``PrefillSender`` (its cluster key from ``HYBRIDKV_CLUSTER_KEY``,
which ``StageProcess`` sets) and hands the requests over. Prints one JSON
line per event: ``ready``, one ``report`` per finished request, ``exit`` at the end.

Invariants:
- The process owns its memory (``reservations.send`` pins what it hands over): it releases a
  request's pin once the sender reported it finished, never earlier.
- The process ends by itself: after every request finished, after ``timeout_s + 10`` s,
  or as soon as its parent process is gone; before ``exit`` it frees what finished and
  checks ``mem.verify()``.
- ``slow_s`` wraps the real transport and only sleeps before each submit (fault injection:
  a test can stop or kill the rank mid-transfer); it never changes what is written.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import Parallel, ShardSpec, get_preset
from hybridkv.testing.pattern import fill
from hybridkv.testing.reservations import send
from hybridkv.transfer.prefill import PrefillSender
from hybridkv.transfer.transport import Transport, make_transport
from hybridkv.transfer.transport.drills import Throttled


def emit(**event: object) -> None:
    print(json.dumps(event), flush=True)


def main(cfg: dict[str, Any]) -> None:
    parent = os.getppid()
    shard = ShardSpec(get_preset(cfg["model"]), Parallel(cfg["tp"], cfg["pp"]), cfg["pp_rank"], cfg["tp_rank"])
    mem = UnifiedMemory.create(shard, cfg["budget"], **cfg["memory"])
    transport: Transport = make_transport(cfg["transport"])
    if cfg.get("slow_s"):
        transport = Throttled(transport, cfg["slow_s"])
    held = []
    for rid, seq_len, seed in cfg["requests"]:
        mem.alloc_pages(cfg["pp_rank"] + 2)  # shift cells away from the decode's
        pages = mem.alloc_pages(-(-seq_len // mem.page_size))[::-1].copy()
        slot = int(mem.alloc_state(1)[0]) if mem.slot_pools else None
        fill(mem, pages, slot, seq_len, seed)
        held.append((rid, pages, slot, seq_len))
    timeout_s = cfg.get("timeout_s", 30.0)
    sender = PrefillSender(
        mem,
        cfg["engine"],
        cfg["bootstrap"],
        transport,
        timeout_s=timeout_s,
        peer_timeout_s=cfg.get("peer_timeout_s", 5.0),
        heartbeat_s=0.2,
        chunk_bytes=cfg.get("chunk_bytes", 64 << 20),
    )
    try:
        emit(ready=True, pid=os.getpid())
        gates = {rid: send(sender, rid, pages, slot, seq_len) for rid, pages, slot, seq_len in held}
        done: set[str] = set()
        end = time.monotonic() + timeout_s + 10
        while len(done) < len(held) and time.monotonic() < end and os.getppid() == parent:
            for report in sender.poll():
                done.add(report.request_id)
                gates[report.request_id].release()
                emit(
                    report={
                        "id": report.request_id,
                        "phase": report.phase.label,
                        "reason": report.reason,
                        "nbytes": report.nbytes,
                        "ops": report.ops,
                        "timeline": [[p.label, t] for p, t in report.timeline],
                    }
                )
            time.sleep(0.005)
        for rid, pages, slot, _ in held:
            if rid in done:
                mem.free_pages(pages)
                if slot is not None:
                    mem.free_state(np.array([slot]))
        mem.verify()
    finally:
        sender.close()
        transport.close()
    emit(exit=0, done=sorted(done))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
