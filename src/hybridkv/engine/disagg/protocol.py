"""The router <-> worker messages of a disaggregated server (pickled over one pipe per worker).

Commands go router -> an engine's world rank 0, which broadcasts what it read to every rank
of its engine at a step boundary, so every rank applies the same commands at the same step:
the prefill engine gets ``Prefill`` / ``Abort`` / ``ClearCache`` / ``Probe`` / ``Stop``, the decode engine
``Reserve`` / ``Decode`` / ``Abort`` / ``Probe`` / ``Stop``. Every rank answers a ``Probe`` with
a ``Live`` carrying the probe's ``seq``. Events go worker -> router. ``tid`` is a transfer id:
unique per request and engine epoch, the id the transfer layer sees. Stamps are
``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of a host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridkv.engine.disagg.faults import Fault
from hybridkv.engine.sched.request import FinishReason, SamplingParams

# --- commands ------------------------------------------------------------------------


@dataclass(frozen=True)
class Prefill:
    tid: str
    ids: tuple[int, ...]
    params: SamplingParams  # the first token is chosen with them, as a single engine would
    fault: Fault | None = None  # a deliberate fault of this request (each rank applies its part)
    cache_salt: str | None = None  # its prefix-cache namespace


@dataclass(frozen=True)
class Reserve:
    tid: str
    ids: tuple[int, ...]  # the prompt: its KV arrives by transfer (and it is computed again if retracted)
    params: SamplingParams
    prefill_engine: str  # the bootstrap name of the prefill engine's epoch that computes it


@dataclass(frozen=True)
class Decode:
    tid: str
    first: int  # the first token, chosen by the prefill engine


@dataclass(frozen=True)
class Abort:
    tid: str
    reason: str


@dataclass(frozen=True)
class Probe:
    seq: int  # every worker answers ``Live`` with this number (late answers to an earlier probe are dropped)


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class ClearCache:
    host: bool = False  # the prefill engine empties its prefix cache (written back below); ``host``: host memory too


Command = Prefill | Reserve | Decode | Abort | Probe | Stop | ClearCache

# --- events --------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    pid: int
    shm_path: str  # the decode rank's shared arena file ("" elsewhere): unlinked by the router if it dies
    live: tuple[int, int]  # (pages, slots) live before the first request (reserved ids)


@dataclass(frozen=True)
class Live:
    """A ``Probe``'s answer: what the rank holds now outside its prefix cache, and for how many requests."""

    seq: int  # the ``Probe`` it answers
    live: tuple[int, int]  # (pages, slots) live, less what the prefill prefix cache holds
    requests: int  # requests holding memory here (in flight, held back, quarantined or running)
    threads: int  # the intra-op threads this rank runs (``parallel.cpu_share``)


@dataclass(frozen=True)
class Started:
    tid: str
    at: float
    cached_tokens: int  # the prefix-cache hit every prefill rank agreed on
    cached_details: dict[str, int]  # ``cached_tokens`` by where world rank 0 found its full KV: device, host, storage


@dataclass(frozen=True)
class First:
    tid: str
    token: int
    at: float


@dataclass(frozen=True)
class Sending:
    tid: str  # this prefill rank handed the request to its sender


@dataclass(frozen=True)
class Sent:
    tid: str
    ok: bool
    reason: str
    nbytes: int
    ops: int  # write ops its sender submitted (one per contiguous run: Mooncake over TCP pays per op)
    computed: tuple[float, float]  # this rank's prefill of the request: started, last chunk done
    sending: tuple[float, float]  # handed to the sender -> the sender finished (its last leg ended)


@dataclass(frozen=True)
class Admitted:
    tid: str  # every decode rank holds every prefill rank's KV/state
    at: float
    nbytes: int


@dataclass(frozen=True)
class Tokens:
    """Decode rank 0, after each step: the tokens it chose, ``(tid, token)`` in order."""

    chosen: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Done:
    tid: str
    tokens: tuple[int, ...]  # every output token, the first included
    finish_reason: FinishReason
    at: float
    nbytes: int  # KV/state bytes this decode rank received for it
    retractions: int  # times the decode engine retracted it (then prefilled it again locally)


@dataclass(frozen=True)
class Failed:
    tid: str
    reason: str
    transfer: bool = False  # the transfer layer failed it (timeout, peer, checksum, layout)


@dataclass(frozen=True)
class Report:
    """Sent once at ``Stop``: what the rank holds after draining (equal live counts: nothing leaked)."""

    live_before: tuple[int, int]  # (pages, slots) live before the first request
    live_after: tuple[int, int]
    transfer_bytes: int  # bytes this rank's transfers moved, over every request
    requests: int  # requests this rank handled


@dataclass(frozen=True)
class TierFigures:
    """A prefill rank's tier counters (``EngineTiers.metrics``: bytes written and loaded per tier, misses
    by reason, fallbacks, its host memory and store client): sent when they changed, before each ``Sent``
    and after a ``ClearCache``, else at most once per ``FIGURES_S``. The router keeps the latest per rank."""

    figures: dict[str, Any]


@dataclass(frozen=True)
class Crash:
    traceback: str


Event = (
    Ready | Live | Started | First | Sending | Sent | Admitted | Tokens | Done | Failed | Report | TierFigures | Crash
)
