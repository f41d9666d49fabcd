"""Start and stop a ``mooncake_master`` (the Mooncake Store's metadata service) on loopback.

Tests and the demo run their own master from the ``mooncake`` package; in production the
store tier points at an operator's master instead (``MooncakeStoreTier(master=host:port)``),
which is how several engine hosts share one store.

Every port the master opens is set explicitly and bound to ``127.0.0.1``: its RPC port and
its metrics/admin HTTP port. Its HTTP metadata server (which binds every interface whatever
its host flag says, checked on mooncake 0.3.13) stays off: store clients here use the
transfer engine's P2P handshake instead.

Invariants:
- ``start`` returns only once the master process itself listens on its RPC port, or raises within
  ``start_timeout_s`` with the master's log tail (and leaves no process behind).
- The master dies with this process: it runs in its own session with a parent-death
  signal (Linux ``PR_SET_PDEATHSIG``), ``stop`` terminates then kills it within a bounded
  wait, and an ``atexit`` hook stops it if nobody did.
- ``kill`` (a fault drill) and ``start`` again reuse the same ports.

``python -m hybridkv.tiers`` runs one in the foreground until Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from hybridkv.tiers.base import TierError
from hybridkv.tiers.mooncake_clients import forget as forget_clients

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


def master_binary() -> Path:
    """The ``mooncake_master`` the ``mooncake`` package ships (found without importing the
    package: its import loads the store library, whose log level is read at load)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise TierError("the Mooncake Store needs the 'mooncake' extra (pip install hybridkv[mooncake])")
    path = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
    if not path.is_file():
        raise TierError(f"the mooncake package at {path.parent} ships no mooncake_master binary")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on (Linux ``/proc``):
    the master is up only once *it* listens on its port (another process may hold it)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    out = set()
    for table, v6 in (("tcp", False), ("tcp6", True)):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    out.add((_address(addr, v6), int(port, 16)))
    return out


def _address(hexaddr: str, v6: bool) -> str:
    raw = bytes.fromhex(hexaddr)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, words)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class MooncakeMaster:
    """One ``mooncake_master`` on loopback (a context manager: ``with MooncakeMaster() as m``)."""

    def __init__(
        self,
        *,
        rpc_port: int | None = None,
        metrics_port: int | None = None,
        start_timeout_s: float = 15.0,
        log_path: str | Path | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        self.rpc_port = rpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.start_timeout_s = start_timeout_s
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="mooncake_master_", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        atexit.register(self.stop)

    @property
    def address(self) -> str:
        """``host:port`` of the RPC service, what store clients are given."""
        return f"{LOOPBACK}:{self.rpc_port}"

    def args(self) -> list[str]:
        return [
            str(master_binary()),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
            "--rpc_thread_num=2",
            *self.extra_args,
        ]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> MooncakeMaster:
        if self.running:
            return self
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if (LOOPBACK, self.rpc_port) in listening_sockets(self.proc.pid):
                return self
            time.sleep(0.05)
        code = self.proc.poll()
        self.stop()
        why = f"exited with {code}" if code is not None else f"did not listen within {self.start_timeout_s} s"
        raise TierError(f"mooncake_master on {self.address} {why}; its log ({self.log_path}):\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL (a fault drill: the store tier must notice and carry on)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        forget_clients(self.address)  # while it still answers: nothing is left pinging it
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
