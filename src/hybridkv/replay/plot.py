"""The pool split over simulated time, one panel per replay (e.g. per eviction policy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_pool_split(reports: list[dict[str, Any]], out: str | Path) -> Path:
    """Stacked live bytes per pool plus free bytes (GiB) over time; running requests on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    fig, axes = plt.subplots(len(reports), 1, figsize=(10, 3.2 * len(reports)), squeeze=False)
    for ax, rep in zip(axes[:, 0], reports, strict=True):
        timeline = rep["timeline"]
        t = [s["t"] for s in timeline]
        pools = list(timeline[0]["live_bytes"]) if timeline else []
        layers = [[s["live_bytes"][p] / 2**30 for s in timeline] for p in pools]
        free = [s["free_bytes"] / 2**30 for s in timeline]
        ax.stackplot(t, *layers, free, labels=[*pools, "free"], alpha=0.85)
        ax.set_ylabel("GiB")
        ax.set_xlabel("simulated time (s)")
        ax.set_title(
            f"{rep['model']} on {rep['workload']}: policy {rep['policy']}, hit rate "
            f"{rep['hit_rate']:.3f} (full-only {rep['hit_rate_by_component']['full_only']:.3f})",
            fontsize=9,
        )
        ax.legend(loc="upper left", fontsize=7)
        twin = ax.twinx()
        twin.plot(t, [s["running"] for s in timeline], color="black", linewidth=0.8, label="running")
        twin.set_ylabel("running requests")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
