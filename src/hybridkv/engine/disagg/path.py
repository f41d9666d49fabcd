"""A disaggregated request's path through the two engines (``Outcome.pd``): ``PDPath`` with its
``RequestTiming`` and one ``StageTiming`` per prefill rank.

A leaf: it imports nothing of hybridkv, so ``engine.request`` (whose ``Outcome`` names ``PDPath``) and the
router's ``results`` both read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    """One request's seconds; ``queue + prefill`` is the TTFT, ``transfer`` and ``decode`` follow it."""

    queue_s: float  # submitted -> prefill starts it
    prefill_s: float  # -> the first token
    transfer_s: float  # -> every decode rank holds every prefill rank's KV/state
    decode_s: float  # -> the slowest decode rank has the last token
    ttft_s: float  # submitted -> first token
    tpot_s: float  # decode seconds per token after the first (0 when only one token)


@dataclass(frozen=True)
class StageTiming:
    """One prefill rank's part of a request (``time.monotonic`` stamps, one clock per host)."""

    pp: int
    tp: int
    compute: tuple[float, float]  # its prefill of the request: first scheduled, last chunk done
    send: tuple[float, float]  # handed to its sender -> the sender finished (every decode rank's leg)
    nbytes: int  # bytes it wrote, to every decode rank
    ops: int  # write ops it submitted for them (contiguous runs; a TP-sliced page gives one per token)
    ok: bool
    reason: str = ""  # why its sender failed ("" when ok)


@dataclass(frozen=True)
class PDPath:
    """A disaggregated request's path (``Outcome.pd``): how it went through the two engines."""

    status: str  # FINISHED or FAILED
    timing: RequestTiming | None  # None when failed
    transfer_bytes: int  # KV/state bytes every decode rank received, summed
    attempts: int  # 1, plus one per engine death that held it after it started (it was computed again)
    notes: tuple[str, ...]  # the deaths that re-routed or retried it
    stages: tuple[StageTiming, ...] = ()  # per prefill rank (stage, TP rank) of its last attempt
    decode_bytes: tuple[int, ...] = ()  # bytes each decode TP rank received (finished requests)
    transfer_failed: bool = False  # the transfer layer failed it
