"""WorkerLog: the launcher reads its workers' stderr; Mooncake's own log lines become counted log records.

Each worker process's fd 2 is the write end of a pipe from ``pipe(name)`` (``EngineProcs`` hands
it to the worker, which ``dup2``s it onto fd 2 before anything else). One daemon thread reads
every pipe, line by line:
- a line in glog's format (``E0512 10:11:12.123456  4242 transport.cpp:88] ...``: what Mooncake's
  C++ writes, e.g. the refused connections to a decode rank that was killed) is never written
  raw: it is counted per worker and logged on ``hybridkv.transfer.mooncake``, every line at
  DEBUG, and at WARNING the first of each worker and then at most one per ``WARN_EVERY_S``
  (with the count so far);
- every other line (a Python warning, a library's note) is written unchanged to the launcher's
  fd 2, so it reaches the terminal as before.

Invariants: every pipe is read until EOF (every writer gone), so a worker never blocks on a full
pipe; a line is handled once, whole (a last line without a newline at EOF too); counts only grow;
``close`` stops the thread (bounded) and closes every read end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait

GLOG_LINE = re.compile(rb"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ \]]+:\d+\] ")
WARN_EVERY_S = 10.0
READ_BYTES = 65536
log = logging.getLogger("hybridkv.transfer.mooncake")


@dataclass
class _Source:
    name: str
    partial: bytes = b""
    lines: int = 0  # glog lines so far
    warned_at: float = -WARN_EVERY_S
    quiet: int = 0  # glog lines since the last WARNING


class WorkerLog:
    def __init__(self, passthrough_fd: int = 2) -> None:
        self.passthrough_fd = passthrough_fd  # where the other lines go (the launcher's stderr)
        self._sources: dict[int, _Source] = {}  # read end -> its worker, while open
        self._ended: list[_Source] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()

    def pipe(self, name: str) -> Connection:
        """A new pipe for worker ``name``: the returned write end goes to the worker (close it here once
        handed over); this log reads the other end until every writer closed it."""
        reader, writer = Pipe(duplex=False)
        fd = os.dup(reader.fileno())
        reader.close()
        with self._lock:
            self._sources[fd] = _Source(name)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pd-worker-log", daemon=True)
                self._thread.start()
        self._wake()
        return writer

    def counts(self) -> dict[str, int]:
        """Mooncake log lines per worker name, of every worker so far (ended ones included)."""
        with self._lock:
            out: dict[str, int] = {}
            for src in [*self._sources.values(), *self._ended]:
                out[src.name] = out.get(src.name, 0) + src.lines
            return out

    @property
    def total(self) -> int:
        return sum(self.counts().values())

    def close(self, timeout_s: float = 5.0) -> None:
        """Read what is left (bounded by ``timeout_s``), then stop and close every pipe."""
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            for fd in list(self._sources):
                self._end(fd)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # --- the reader thread ---------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            with self._lock:
                fds = list(self._sources)
            if self._stopping and not fds:
                return
            ready = wait([self._wake_r, *fds], timeout=0.5 if self._stopping else None)
            if self._stopping and not ready:
                return  # nothing more within the bound: close() closes what is left
            for obj in ready:
                fd = int(obj)  # type: ignore[arg-type]  # wait() gives back the plain fds it was given
                if fd == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    continue
                with self._lock:  # read under the lock: close() never closes an fd between wait and read
                    src = self._sources.get(fd)
                    if src is None:
                        continue
                    try:
                        data = os.read(fd, READ_BYTES)
                    except OSError:
                        data = b""
                    if data:
                        self._feed(src, data)
                    else:
                        self._end(fd)

    def _feed(self, src: _Source, data: bytes) -> None:
        *lines, src.partial = (src.partial + data).split(b"\n")
        if len(src.partial) > READ_BYTES:  # a line this long is cut: what is held stays bounded
            lines.append(src.partial)
            src.partial = b""
        for line in lines:
            self._line(src, line)

    def _end(self, fd: int) -> None:
        src = self._sources.pop(fd)
        if src.partial:
            self._line(src, src.partial)
            src.partial = b""
        self._ended.append(src)
        with contextlib.suppress(OSError):
            os.close(fd)

    def _line(self, src: _Source, line: bytes) -> None:
        if not GLOG_LINE.match(line):
            with contextlib.suppress(OSError):
                os.write(self.passthrough_fd, line + b"\n")
            return
        text = line.decode(errors="replace")
        src.lines += 1
        src.quiet += 1
        log.debug("%s: mooncake: %s", src.name, text)
        now = time.monotonic()
        if now - src.warned_at >= WARN_EVERY_S:
            log.warning(
                "%s: mooncake: %s [Mooncake line %d of this worker; %d since the last shown, the others at DEBUG]",
                src.name,
                text,
                src.lines,
                src.quiet,
            )
            src.warned_at, src.quiet = now, 0
