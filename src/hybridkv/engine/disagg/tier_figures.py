"""The prefill ranks' tier counters as the router sees them: ``PDServer.metrics()``'s tier keys.

Each prefill rank (PP stage x TP rank) keeps its own tiers and sends its counters
(``TierFigures``: ``EngineTiers.metrics`` of that rank) when they changed; ``EngineState.figures``
holds the latest per rank of each engine epoch. ``tier_metrics`` sums them over every rank of
every epoch (a rank's counters are cumulative over its process; a restarted epoch starts from
zero, so the sum is the server's total) and lists each rank's own. Bounded: one dict per rank,
its keys fixed by the tiers (tier names, miss reasons, component labels), whatever the traffic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from hybridkv.engine.disagg.engines import EngineState
from hybridkv.engine.sched.scheduler import Role

_SUMMED = ("written_bytes", "loaded_bytes", "write_refused", "write_around", "misses")


def tier_metrics(engines: Iterable[EngineState], tiered: bool) -> dict[str, Any]:
    """``tier_written_bytes`` / ``tier_loaded_bytes`` / ``tier_write_refused`` (per tier), ``tier_write_around``
    (per component),
    ``tier_misses`` (per reason), ``tier_fallbacks``, ``tier_store_down_events`` summed over every
    prefill rank; ``tier_store_ranks_down`` (ranks of the live engine whose store is down now);
    ``prefill_tiers``: each rank's latest counters, by "<rank> (epoch N)". Empty without tiers."""
    if not tiered:
        return {}
    sums: dict[str, Counter[str]] = {k: Counter() for k in _SUMMED}
    fallbacks = down_events = down_now = 0
    ranks: dict[str, dict[str, Any]] = {}
    for e in engines:
        if e.role is not Role.PREFILL:
            continue
        for r, f in sorted(e.figures.items()):
            ranks[f"{e.names[r]} (epoch {e.epoch})"] = f
            for k in _SUMMED:
                sums[k].update(f[k])
            fallbacks += f["fallbacks"]
            store = f.get("store")
            if store is not None:
                down_events += store["down_events"]
                down_now += int(not e.dead and not store["up"])
    return {
        **{f"tier_{k}": dict(v) for k, v in sums.items()},
        "tier_fallbacks": fallbacks,
        "tier_store_down_events": down_events,
        "tier_store_ranks_down": down_now,
        "prefill_tiers": ranks,
    }
