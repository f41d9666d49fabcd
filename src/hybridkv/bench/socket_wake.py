"""What one streamed chunk's ``send(2)`` costs on this machine when its reader sleeps: the floor under streaming.

A reader process (started here, on 127.0.0.1) blocks in ``recv`` as an HTTP client waits for its next
token. This thread sends it ``count`` chunks of ``size`` bytes over TCP (no Nagle delay); before each it
does what a server's engine thread does between tokens, ``between`` (the bench passes one engine step),
or by default copies ``scratch`` bytes; either leaves the core's caches holding other data than the
socket code's. It times each ``send``'s CPU (thread time). On loopback the kernel delivers the bytes and
wakes the reader inside the sender's call, so the figure is what any server pays per chunk here before
any encoding; in a virtual machine, waking a sleeping virtual CPU makes it many times what the copy of
the bytes costs, and after a real engine step (its weights, activations and Python objects through the
caches) more than after a plain copy: measured here, about 90 µs against 37 (p50), 13 back to back.

Invariants: the reader is a child process of this one, connected only to a socket this process listens on;
it ends when the connection closes, and it is killed if it has not ended ``timeout_s`` later. Nothing
outside loopback is touched.
"""

from __future__ import annotations

import functools
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

_READER = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=60) as conn:
    while conn.recv(1 << 16):
        pass
"""


def send_wake_us(
    count: int = 100,
    size: int = 180,
    scratch: int = 8 << 20,
    timeout_s: float = 30.0,
    between: Callable[[], object] | None = None,
) -> list[float]:
    """CPU microseconds of each of ``count`` sends of ``size`` bytes to a reader process that sleeps between them,
    each right after ``between()`` (default: a copy of ``scratch`` bytes)."""
    if count < 1 or size < 1 or scratch < 0:
        raise ValueError(f"send_wake_us: count {count} and size {size} must be >= 1, scratch {scratch} >= 0")
    if between is None:
        source, target = np.ones(scratch, dtype=np.uint8), np.empty(scratch, dtype=np.uint8)
        between = functools.partial(np.copyto, target, source)  # a step's worth of other data through the caches
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(timeout_s)
        reader = subprocess.Popen([sys.executable, "-c", _READER, str(listener.getsockname()[1])])
        try:
            conn, _ = listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                chunk = b"x" * size
                spent = []
                for _ in range(count):
                    between()
                    start = time.thread_time()
                    conn.sendall(chunk)
                    spent.append((time.thread_time() - start) * 1e6)
            reader.wait(timeout=timeout_s)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
    return spent
