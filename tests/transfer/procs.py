"""Test harness: prefill workers in child processes and decode ranks in the test process.

Every child is killed and reaped at teardown; every read has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import ModelSpec, Parallel, ShardSpec, get_preset
from hybridkv.transfer import DecodeReceiver, make_transport, shared_memory

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-swa2-state"
MEMORY = {"page_size": 4, "max_context": 64, "chunk_tokens": 16}


class Worker:
    def __init__(self, cfg: dict) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the worker)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.transfer.prefill_worker", json.dumps(cfg)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.events.put(json.loads(line))

    def expect(self, key: str, timeout_s: float = 30.0) -> dict:
        """The next event that has ``key``; fails with the child's stderr on timeout."""
        while True:
            try:
                event = self.events.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"worker sent no {key!r} within {timeout_s} s; {self.describe()}") from None
            if key in event:
                return event

    def describe(self) -> str:
        """Exit code and the tail of stderr, for failure messages."""
        self.log.seek(0)
        return f"worker exit {self.proc.poll()}, stderr:\n{self.log.read()[-3000:]}"

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def worker_config(bootstrap: str, transport: str, pp_rank: int, requests: list, **extra: object) -> dict:
    return {
        "bootstrap": bootstrap,
        "engine": "pre",
        "model": MODEL,
        "pp": 2,
        "tp": 1,
        "pp_rank": pp_rank,
        "tp_rank": 0,
        "transport": transport,
        "page_size": MEMORY["page_size"],
        "budget": "1MiB",
        "requests": requests,
        **extra,
    }


@contextlib.contextmanager
def decode_rank(
    bootstrap: str,
    transport: str,
    tp: int = 1,
    tp_rank: int = 0,
    model: str | ModelSpec = MODEL,
    page_size: int = MEMORY["page_size"],
    **kw: object,
) -> Iterator[tuple[DecodeReceiver, UnifiedMemory]]:
    """A decode rank in this process; its memory is shared memory for the shm transport."""
    spec = get_preset(model) if isinstance(model, str) else model
    shard = ShardSpec(spec, Parallel(tp, 1), 0, tp_rank)
    hints = dict(MEMORY, page_size=page_size)
    shared = None
    if transport == "shm":
        mem, shared = shared_memory(shard, "1MiB", **hints)
    else:
        mem = UnifiedMemory.create(shard, "1MiB", **hints)
    mem.arena.buffer.zero_()
    link = make_transport(transport, shared)
    receiver = DecodeReceiver(mem, "dec", bootstrap, link, heartbeat_s=0.2, **kw)
    try:
        yield receiver, mem
    finally:
        receiver.close()
        link.close()
        if shared is not None:
            shared.close()
