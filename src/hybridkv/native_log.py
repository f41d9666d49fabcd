"""Quiet start-up of a native library: its known harmless start-up lines on fd 2 are dropped, nothing else.

Mooncake's C++ (the transfer engine, and the store client that embeds one) logs through glog,
which it never initialises: in P2P-handshake mode its set-up looks its own segment up before it
has published one, and prints, once per process, "WARNING: Logging before InitGoogleLogging() is
written to STDERR" and, per engine, "E... transfer_metadata.cpp:...] Local segment descriptor not
found". Both are harmless (the descriptor is created right after), but an error-level line on a
run that succeeds sends users hunting. ``init_log`` runs such a set-up with fd 2 captured.

Invariants: only lines matching ``HARMLESS_INIT_LINES`` whole are dropped; every other line the
process wrote meanwhile is written back to fd 2, in order, and handed to the caller (a failed
set-up quotes them); one capture at a time per process (fd 2 is the process's).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

HARMLESS_INIT_LINES = (
    re.compile(r"WARNING: Logging before InitGoogleLogging\(\) is written to STDERR"),
    re.compile(r"E\d{4} [0-9:.]+ +\d+ transfer_metadata\.cpp:\d+\] Local segment descriptor not found"),
)
_FD2_LOCK = threading.Lock()


@contextlib.contextmanager
def init_log() -> Iterator[list[str]]:
    """Capture this process's fd 2 while the block runs; afterwards the yielded list holds every
    line written meanwhile except ``HARMLESS_INIT_LINES``, and those lines are written back to fd 2."""
    kept: list[str] = []
    with _FD2_LOCK, tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            yield kept
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            lines = log.read().decode(errors="replace").splitlines()
            kept += [line for line in lines if not any(p.fullmatch(line.strip()) for p in HARMLESS_INIT_LINES)]
            if kept:
                os.write(2, "".join(line + "\n" for line in kept).encode())
