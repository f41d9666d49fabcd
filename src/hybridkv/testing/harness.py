"""Multi-process transfer harness: prefill ranks in child processes, decode ranks in this one.

Used by ``hybridkv pd-demo`` and the transfer tests. A ``StageProcess`` runs one prefill
rank (``python -m hybridkv.testing.stage_worker``) that fills its requests' pages with the
byte ``pattern`` and hands them to a real ``PrefillSender``; it reports over stdout, one
JSON line per event. ``decode_rank`` builds a decode rank (memory, transport,
``DecodeReceiver``) in this process.

Invariants:
- Every rank of one test or demo shares one cluster key: the caller generates it
  (``ClusterKey.generate``) and passes it; a ``StageProcess`` hands it to its child in the
  environment (``HYBRIDKV_CLUSTER_KEY``), never on the command line.
- ``StageProcess.close`` kills and reaps the child (also a stopped one) and closes its pipe
  and log; every wait on a child has a timeout, and a timeout names the child's exit code
  and the tail of its stderr. A child whose parent dies exits on its own (it watches its
  parent id).
- ``decode_rank`` closes its receiver, its transport and its shared-memory file on exit,
  also when the body raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import FullAttention, Linear, ModelSpec, Parallel, ShardSpec, StateTensor, get_preset
from hybridkv.transfer.auth import KEY_ENV, KEY_FILE_ENV, ClusterKey
from hybridkv.transfer.decode import DecodeReceiver
from hybridkv.transfer.shared import shared_memory
from hybridkv.transfer.transport import make_transport, transport_class

MODEL = "tiny-swa2-state"
MEMORY = {"page_size": 4, "max_context": 64, "chunk_tokens": 16}
BUDGET = "1MiB"

StageRequest = tuple[str, int, int]  # (request id, seq_len, pattern seed)


class StageProcess:
    """One prefill rank in a child process; ``expect`` reads its JSON events."""

    def __init__(self, cfg: dict[str, Any], key: ClusterKey) -> None:
        self.cfg = cfg
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the child)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybridkv.testing.stage_worker", json.dumps(cfg)],
            env={**{k: v for k, v in os.environ.items() if k != KEY_FILE_ENV}, KEY_ENV: key.hex},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, name=f"stage-{self.proc.pid}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.suppress(ValueError, OSError):  # the pipe closed under us at close()
            for line in self.proc.stdout:
                with contextlib.suppress(ValueError):
                    self.events.put(json.loads(line))

    def expect(self, key: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The next event that has ``key``; ``TimeoutError`` (with the child's stderr) otherwise."""
        while True:
            try:
                event = self.events.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"stage process sent no {key!r} within {timeout_s} s; {self.describe()}") from None
            if key in event:
                return event

    def describe(self) -> str:
        """Exit code and the tail of stderr, for failure messages."""
        self.log.seek(0)
        return f"stage process exit {self.proc.poll()}, stderr:\n{self.log.read()[-3000:]}"

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def stage_config(
    bootstrap: str,
    transport: str,
    pp_rank: int,
    requests: list[StageRequest],
    *,
    model: str = MODEL,
    engine: str = "pre",
    pp: int = 2,
    **extra: object,
) -> dict[str, Any]:
    """The JSON config of one prefill rank (TP 1) of a ``pp``-stage prefill engine.

    ``extra``: ``timeout_s``, ``peer_timeout_s``, ``chunk_bytes``, ``slow_s`` (sleep before
    every transport write, so a test can stop or kill the rank mid-transfer).
    """
    return {
        "bootstrap": bootstrap,
        "engine": engine,
        "model": model,
        "pp": pp,
        "tp": 1,
        "pp_rank": pp_rank,
        "tp_rank": 0,
        "transport": transport,
        "memory": MEMORY,
        "budget": BUDGET,
        "requests": [list(r) for r in requests],
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
    engine: str = "dec",
    *,
    key: ClusterKey,
    **kw: object,
) -> Iterator[tuple[DecodeReceiver, UnifiedMemory]]:
    """A decode rank in this process (zeroed memory; shared memory where the transport needs it)."""
    spec = get_preset(model) if isinstance(model, str) else model
    shard = ShardSpec(spec, Parallel(tp, 1), 0, tp_rank)
    hints: dict[str, Any] = dict(MEMORY, page_size=page_size)
    with contextlib.ExitStack() as stack:
        shared = None
        if transport_class(transport).shared_arena:
            mem, shared = shared_memory(shard, BUDGET, **hints)
            stack.callback(shared.close)
        else:
            mem = UnifiedMemory.create(shard, BUDGET, **hints)
        mem.arena.buffer.zero_()
        link = make_transport(transport, shared)
        stack.callback(link.close)
        receiver = DecodeReceiver(mem, engine, bootstrap, link, heartbeat_s=0.2, key=key, **kw)  # type: ignore[arg-type]
        stack.callback(receiver.close)
        yield receiver, mem


def variant(name: str, **changes: Any) -> ModelSpec:
    """The preset with the same name but a changed geometry: a misconfigured peer.

    ``head_dim`` changes every full-attention layer's head size, ``state_dim`` every
    recurrent state tensor's trailing dimensions, ``kv_dtype`` the KV dtype.
    """
    base = get_preset(name)
    layers = []
    for layer in base.layers:
        kind = layer.kind
        if isinstance(kind, FullAttention) and "head_dim" in changes:
            kind = FullAttention(kind.num_kv_heads, changes["head_dim"], changes["head_dim"])
        if isinstance(kind, Linear) and "state_dim" in changes:
            states = tuple(
                StateTensor(s.name, (s.shape[0], *[changes["state_dim"]] * (len(s.shape) - 1)), s.dtype, s.tp_dim)
                for s in kind.states
            )
            kind = Linear(kind.variant, states)
        layers.append(dataclasses.replace(layer, kind=kind))
    return dataclasses.replace(base, layers=tuple(layers), kv_dtype=changes.get("kv_dtype", base.kv_dtype))
