"""What this machine's CPU is: the fields of Linux's ``/proc/cpuinfo`` (the first processor's).

Invariants: the file is read once per process; where it cannot be read (not Linux) every field is None, and callers
fall back to what they do for an unknown CPU.
"""

from __future__ import annotations

import functools


def field(cpuinfo: str, key: str) -> str | None:
    """The value of the first ``key : value`` line of ``cpuinfo`` (``/proc/cpuinfo``'s text), None if none names
    ``key``."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return None


@functools.cache
def _text() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_field(key: str) -> str | None:
    """This machine's ``key`` (``vendor_id``, ``model name``, ...), None where ``/proc/cpuinfo`` has none."""
    return field(_text(), key)
