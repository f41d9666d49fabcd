"""How many CPU threads each worker process of an engine runs: its share of this host's CPUs.

torch gives every process one intra-op thread per core. A disaggregated server or a launch runs
several worker processes on one host, so by default they run ``processes x cores`` threads that
take the cores from each other and wait for each other at every collective (measured on 2 cores:
a PP2 prefill + TP2 decode server decoded 5-40x slower per token than with one thread each).

Invariants:
- An explicit ``OMP_NUM_THREADS`` (a positive integer: the operator's choice) is what every
  worker runs.
- Otherwise each of ``processes`` workers runs ``max(1, cpus // processes)`` threads, ``cpus``
  being the CPUs this process may run on (its affinity mask, not the machine's count).
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def worker_threads(processes: int) -> int:
    """Intra-op threads for each of ``processes`` workers started from this process."""
    if processes < 1:
        raise ValueError(f"an engine runs at least one worker process, got {processes}")
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    return max(1, usable_cpus() // processes)
