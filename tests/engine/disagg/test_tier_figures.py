"""The router's sums of the prefill ranks' tier counters (``tier_metrics``), over ranks and engine epochs.

The figures are a real engine's (``EngineTiers.metrics`` after a hit restored from host memory, and
with a store that is down); the engines are the router's records of two prefill epochs (the first
died, its last figures kept) and a decode engine (no tiers): sums cover every prefill rank of every
epoch, a store counts as down now only on the live epoch, and a server without tiers adds no keys.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hybridkv.engine.disagg.tier_figures import tier_metrics
from hybridkv.engine.sched.scheduler import Role
from tests.engine.test_tiers import A, engine, run, turn

NAME = "tiny-qwen3-next"


def figures() -> dict[str, Any]:
    """A real rank's counters: a prefix restored from host memory."""
    e = engine(NAME, host_memory="8MiB")
    try:
        run(e, NAME, A, "s")
        e.clear_cache()
        assert run(e, NAME, turn(1), "s").cached_tokens_details["host"] == 40
        assert e.tiers is not None
        return e.tiers.metrics()
    finally:
        e.close()


def test_the_router_sums_every_prefill_rank_of_every_epoch_and_counts_a_store_down_only_on_the_live_one() -> None:
    f = figures()
    assert f["loaded_bytes"]["host"] > 0 and f["written_bytes"]["host"] > 0
    down = {**f, "misses": {"down": 3}, "fallbacks": 1, "store": {"name": "mooncake", "up": False, "down_events": 2}}
    names = ["prefill stage 0 TP rank 0", "prefill stage 1 TP rank 0"]
    dead = SimpleNamespace(role=Role.PREFILL, epoch=0, names=names, figures={0: down, 1: f}, dead=True)
    live = SimpleNamespace(role=Role.PREFILL, epoch=1, names=names, figures={0: f, 1: down}, dead=False)
    decode = SimpleNamespace(role=Role.DECODE, epoch=0, names=["decode TP rank 0"], figures={0: down}, dead=False)
    m = tier_metrics([live, dead, decode], tiered=True)  # type: ignore[list-item]
    assert m["tier_loaded_bytes"] == {"host": 4 * f["loaded_bytes"]["host"]}
    assert m["tier_written_bytes"] == {"host": 4 * f["written_bytes"]["host"]}
    assert m["tier_misses"] == {"down": 6} and m["tier_fallbacks"] == 2 * (down["fallbacks"] + f["fallbacks"])
    assert m["tier_store_down_events"] == 4 and m["tier_store_ranks_down"] == 1  # the dead epoch's rank: not now
    assert sorted(m["prefill_tiers"]) == sorted(f"{n} (epoch {e})" for n in names for e in (0, 1))
    assert m["prefill_tiers"]["prefill stage 1 TP rank 0 (epoch 1)"] is down
    assert tier_metrics([live], tiered=False) == {}  # type: ignore[list-item]
