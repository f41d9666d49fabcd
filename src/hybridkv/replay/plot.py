"""Figures of replays: the pool split over simulated time, one panel per replay (e.g. per
eviction policy); hit rate against memory size, one line per policy and checkpoint placement."""

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


def plot_hit_vs_memory(reports: list[dict[str, Any]], out: str | Path) -> Path:
    """Hit rate (served: valid for every component) against the memory budget: one colour per
    checkpoint placement, one line style per eviction policy, and in black the full-KV-only hit
    rate of the ``none`` placement's run (or of the first placement's when ``none`` was not
    run) per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybridkv.memory import parse_bytes

    out = Path(out)
    lines: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for rep in reports:
        gib = parse_bytes(rep["gpu_memory"]) / 2**30
        key = (rep["policy"], rep["checkpoints"]["placement"])
        lines.setdefault(key, []).append((gib, rep["hit_rate"], rep["hit_rate_by_component"]["full_only"]))
    policies = list(dict.fromkeys(p for p, _ in lines))
    placements = list(dict.fromkeys(c for _, c in lines))
    styles = ("-", "--", ":", "-.")
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for policy in policies:
        style = styles[policies.index(policy) % len(styles)]
        reference = "none" if (policy, "none") in lines else placements[0]
        points = sorted(lines[policy, reference])
        ax.plot(
            [p[0] for p in points],
            [p[2] for p in points],
            color="black",
            linestyle=style,
            marker="s",
            label=f"full KV only ({reference} run), {policy}",
        )
        for placement in placements:
            points = sorted(lines.get((policy, placement), []))
            if points:
                colour = colours(placements.index(placement) % 10)
                x, y = [p[0] for p in points], [p[1] for p in points]
                ax.plot(x, y, color=colour, linestyle=style, marker="o", label=f"hybrid, {placement}, {policy}")
    xs = sorted({p[0] for points in lines.values() for p in points})
    first = reports[0]
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("KV memory per device (GiB)")
    ax.set_ylabel("prefix hit rate (tokens)")
    ax.set_title(f"{first['model']} on {first['workload']}, {first['requests']:,} requests", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
