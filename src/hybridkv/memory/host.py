"""What a device can still hold: checked before a budget or a model is allocated on it.

A size the machine cannot hold must be a user error naming the size and what is available,
not the allocator's failure deep inside ``torch`` (or the OOM killer).

Invariants:
- ``available_bytes("cpu")`` is the smallest of ``MemAvailable`` (``/proc/meminfo``; else the
  available physical pages from ``os.sysconf``) and the room left under this process's cgroup
  memory limit (v2 or v1); on CUDA it is ``torch.cuda.mem_get_info``'s free bytes; ``None`` when the
  device cannot tell (nothing is refused then).
- ``check_fits`` raises ``LayoutError`` (a ``ValueError``: the CLI's user-error path) and
  allocates nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hybridkv.memory.errors import LayoutError
from hybridkv.units import format_bytes


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 ``memory.max`` or v1
    ``memory.limit_in_bytes``); None when there is no limit or no cgroup to read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":  # v2
            files = (Path("/sys/fs/cgroup") / group.lstrip("/"), "memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1 (the path may be outside this namespace's mount)
            root = Path("/sys/fs/cgroup/memory")
            base = root / group.lstrip("/")
            files = (base if base.is_dir() else root, "memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        base, limit_file, usage_file = files
        try:
            limit = (base / limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                return max(0, int(limit) - int((base / usage_file).read_text()))
        except (OSError, ValueError):
            continue
    return None


def available_bytes(device: str | torch.device) -> int | None:
    """Bytes ``device`` can still allocate (None: it cannot tell)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        known = [n for n in (_meminfo_available(), _cgroup_room()) if n is not None]
        return min(known) if known else None
    if dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(dev)[0])
    return None


def check_fits(nbytes: int, device: str | torch.device, what: str, fix: str) -> None:
    """``LayoutError`` when ``device`` cannot hold ``nbytes`` more (``what`` names them, ``fix`` says
    what to change)."""
    available = available_bytes(device)
    if available is not None and nbytes > available:
        raise LayoutError(
            f"{what} needs {format_bytes(nbytes)} but {torch.device(device)} has {format_bytes(available)} "
            f"available; {fix}"
        )
