"""Figures of a replay: hit rate overall and per component, evictions, concurrency, speed.

Per component, a hit is counted at the longest length valid for that set of rules:
``full_only`` (page-aligned full-KV match), ``full+swa`` (plus every window resident),
``full+state`` (plus a recurrent-state checkpoint at the end), ``all`` (every rule: the hit
served), and ``full+<pool>`` per window pool (that window alone). A model without windows
(or without recurrent layers) has ``full+swa`` (or ``full+state``) equal to ``full_only``: a
rule it does not have costs nothing. ``validity_cost`` is how much hit rate each rule costs
against full-only.
``checkpoints``: the placement, the state checkpoints held (cached or reserved: peak and
at the end, in slots and bytes) and those skipped for lack of room; ``recomputed_tokens``:
prefill tokens whose full KV was cached but not valid for every component.
"""

from __future__ import annotations

from typing import Any

from hybridkv.replay.simulator import ReplayResult


def build_report(res: ReplayResult, with_timeline: bool = True) -> dict[str, Any]:
    cfg = res.config
    inputs = max(1, res.input_tokens)
    rate = {
        "full_only": res.full_hit_tokens / inputs,
        "full+swa": res.window_hit_tokens / inputs,
        "full+state": res.checkpoint_hit_tokens / inputs,
        "all": res.hit_tokens / inputs,
        **{f"full+{label}": n / inputs for label, n in res.window_hit_tokens_each.items()},
    }
    cache = res.cache
    report: dict[str, Any] = {
        "workload": res.workload,
        "model": res.model,
        "gpu_memory": cfg.gpu_memory,
        "page_size": cfg.page_size,
        "policy": cfg.policy,
        "cache_tokens": "inf" if cfg.cache_tokens is None else cfg.cache_tokens,
        "requests": res.requests,
        "input_tokens": res.input_tokens,
        "hit_tokens": res.hit_tokens,
        "hit_rate": rate["all"],
        "hit_rate_by_component": rate,
        "validity_cost": {
            "swa": rate["full_only"] - rate["full+swa"],
            "state": rate["full_only"] - rate["full+state"],
            "all": rate["full_only"] - rate["all"],
        },
        "evictions": {
            "full_pages": cache.get("evicted_pages", 0),
            "window_pages_tombstoned": cache.get("tombstoned_pages", {}),
            "window_cached_pages_reclaimed": cache.get("reclaimed_window_cached_pages", {}),
            "states": cache.get("evicted_states", 0),
            "states_over_path_cap": cache.get("capped_states", 0),
            "duplicate_pages_freed": cache.get("duplicate_pages", 0),
            "window_pages_adopted": cache.get("adopted_pages", 0),
        },
        "checkpoints": {
            "placement": cfg.checkpoints,
            "max_per_path": cfg.max_checkpoints_per_path,
            "peak_slots": res.peak_checkpoint_slots,
            "end_slots": res.end_checkpoint_slots,
            "peak_bytes": res.peak_checkpoint_slots * res.state_slot_bytes,
            "end_bytes": res.end_checkpoint_slots * res.state_slot_bytes,
            "skipped": res.checkpoints_skipped,
            "given_up": cache.get("given_up_states", 0),
        },
        "recomputed_tokens": res.recomputed_tokens,
        "retractions": res.retractions,
        "peak_running": res.peak_running,
        "peak_waiting": res.peak_waiting,
        "peak_live_pages": res.peak_live_pages,
        "prefill_tokens": res.prefill_tokens,
        "decode_tokens": res.decode_tokens,
        "cache_at_end": cache,
        "memory_at_end": res.memory,
        "speed": {
            "wall_s": res.wall_seconds,
            "requests_per_s": res.requests / res.wall_seconds if res.wall_seconds else 0.0,
            "simulated_s": res.sim_seconds,
            "trace_span_s": res.trace_seconds,
            "simulated_s_per_wall_s": res.sim_seconds / res.wall_seconds if res.wall_seconds else 0.0,
            "steps": res.steps,
        },
    }
    if res.tiers:
        report["tiers"] = res.tiers
    if with_timeline:
        report["timeline"] = res.timeline
    return report


def compare(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run (memory, policy, placement): the figures that differ between them."""
    return [
        {
            "gpu_memory": r["gpu_memory"],
            "policy": r["policy"],
            "checkpoints": r["checkpoints"]["placement"],
            "hit_rate": r["hit_rate"],
            "full_only": r["hit_rate_by_component"]["full_only"],
            "evicted_full_pages": r["evictions"]["full_pages"],
            "tombstoned_window_pages": sum(r["evictions"]["window_pages_tombstoned"].values()),
            "evicted_states": r["evictions"]["states"],
            "retractions": r["retractions"],
            "prefill_tokens": r["prefill_tokens"],
            "recomputed_tokens": r["recomputed_tokens"],
            "checkpoint_bytes_peak": r["checkpoints"]["peak_bytes"],
            "checkpoint_bytes_end": r["checkpoints"]["end_bytes"],
        }
        for r in reports
    ]
