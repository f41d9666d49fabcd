"""Is a writer process still alive? Same-host answers from ``/proc``; other hosts: unknown.

Invariants:
- ``gone`` answers True only with proof: the process runs on this host (same boot id and
  pid namespace) and ``/proc/<pid>`` is missing, a zombie, or belongs to a process with
  another start time (the pid was reused). Anything else (another host, an unreadable
  ``/proc``) is False: a writer is presumed alive until proven gone.
"""

from __future__ import annotations

import functools
import os

from hybridkv.transfer.messages import Process


@functools.cache
def _host() -> str:
    """This kernel boot and pid namespace; '' when ``/proc`` cannot say (no liveness proofs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in ticks) of ``pid``, None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except FileNotFoundError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and ')'
    return fields[0], int(fields[19])


def this_process() -> Process:
    pid = os.getpid()
    stat = _stat(pid)
    return Process(_host(), pid, stat[1] if stat else 0)


def gone(proc: Process) -> bool:
    """True only when ``proc`` is proven to have exited (see the module invariants)."""
    if not proc.host or proc.host != _host() or proc.pid <= 0:
        return False
    try:
        stat = _stat(proc.pid)
    except (OSError, ValueError, IndexError):
        return False
    return stat is None or stat[0] in ("Z", "X") or stat[1] != proc.start
