"""glibc ``malloc`` kept from giving the engine's step-sized host buffers back to the kernel.

A CPU step makes and frees many tensors of hundreds of KiB to a few MiB (projections, conv and scan buffers of a
1024-token prefill). glibc serves those above its mmap threshold with fresh ``mmap`` pages and trims the heap top
after frees, so each step page-faults (and zeroes) its working set again: ~10% of a widened Qwen3-Next bf16 prefill
step on this CPU (0.72-0.78 -> 0.66-0.70 CPU s, alternating processes). ``keep_freed_host_memory`` raises the mmap
threshold to glibc's 64-bit maximum (32 MiB) and the trim threshold to 1 GiB, so freed blocks are reused in place
(vLLM's CPU backend gets the same from a preloaded tcmalloc).

Invariants: at most once per process; only under glibc (``mallopt`` found in the C library) and only when the user
chose no allocator settings of their own (no ``MALLOC_*`` variable, no preloaded ``malloc`` library); the cost is that
the process's resident memory stays at its peak instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (4 * 1024 * 1024 * sizeof(long))
TRIM_THRESHOLD = 1 << 30


def _user_chose_an_allocator() -> bool:
    return any(name.startswith("MALLOC_") for name in os.environ) or "malloc" in os.environ.get("LD_PRELOAD", "")


@functools.cache
def keep_freed_host_memory() -> bool:
    """Apply the thresholds (once); True when they were set."""
    if _user_chose_an_allocator():
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
