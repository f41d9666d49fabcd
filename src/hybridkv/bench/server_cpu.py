"""A ``hybridkv serve`` process's CPU, read from its ``/metrics``, and what reading it costs.

Invariants: every figure is a difference of two readings of the server's own counters (seconds; the process
total in 10 ms clock ticks); ``scrape_share`` is measured on the same server, so taking it out leaves what
happened between the readings besides the readings themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import httpx
import numpy as np


class Served(Protocol):
    """A server to read: its base URL and the headers its requests need."""

    @property
    def url(self) -> str: ...

    @property
    def headers(self) -> dict[str, str]: ...


class ServerCpu(NamedTuple):
    """A server's CPU seconds so far (from ``/metrics``)."""

    process: float
    engine_thread: float
    loop: float
    stream_write: float  # the part of engine_thread spent writing streamed chunks (serving, not computing)


NO_CPU = ServerCpu(0.0, 0.0, 0.0, 0.0)

CPU_SERIES = (
    "process_cpu_seconds_total",
    "hybridkv_engine_thread_cpu_seconds_total",
    "hybridkv_http_loop_cpu_seconds_total",
    "hybridkv_stream_write_cpu_seconds_total",
)


def server_cpu(target: Served) -> ServerCpu:
    text = httpx.get(f"{target.url}/metrics", headers=target.headers, timeout=60).text
    found = []
    for name in CPU_SERIES:
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        if match is None:
            raise RuntimeError(f"{target.url}/metrics has no {name}")
        found.append(float(match.group(1)))
    return ServerCpu(*found)


@dataclass
class Cpu:
    """CPU seconds over one phase: the engine driven here, the server (``ServerCpu`` summed), the client here."""

    engine: float = 0.0
    server: ServerCpu = NO_CPU
    client: float = 0.0

    def add_server(self, used: ServerCpu) -> None:
        self.server = ServerCpu(*(a + b for a, b in zip(self.server, used, strict=True)))


def used_between(before: ServerCpu, after: ServerCpu, scrape: ServerCpu = NO_CPU) -> ServerCpu:
    """A server's CPU between two readings of ``/metrics``, less ``scrape`` (``scrape_share``)."""
    return ServerCpu(*(a - b - s for a, b, s in zip(after, before, scrape, strict=True)))


def scrape_share(target: Served, samples: int = 5) -> ServerCpu:
    """The CPU that two readings of ``/metrics`` with nothing between them find (median of ``samples``): the part
    of the scrapes themselves that lands between any two readings (the loop renders and parses a scrape on either
    side of its clock reading; the engine thread gathers the engine's figures before reading its clock)."""
    pairs = [(server_cpu(target), server_cpu(target)) for _ in range(samples)]
    return ServerCpu(*np.median([used_between(a, b) for a, b in pairs], axis=0).tolist())
