"""``hybridkv replay``: serve a real trace through memory + cache (tables only) and report hit
rate, evictions, concurrency and the pool split."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from hybridkv.cli.app import app
from hybridkv.cli.params import byte_size, positive_finite, preset

if TYPE_CHECKING:
    from hybridkv.replay.tiered import TierConfig


def _cache_tokens(text: str) -> int | None:
    if text.strip().lower() in ("inf", "unbounded", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise typer.BadParameter(f"--cache-tokens takes a token count or 'inf', got {text!r}") from None
    if value < 0:
        raise typer.BadParameter(f"--cache-tokens must be >= 0, got {value}")
    return value


def _policies(text: str) -> list[str]:
    from hybridkv.cache import POLICIES

    names = sorted(POLICIES) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise typer.BadParameter(f"unknown policy {unknown or text!r}; choose from {sorted(POLICIES)} or 'all'")
    return names


def _memories(text: str) -> list[str]:
    sizes = [m.strip() for m in text.split(",") if m.strip()]
    if not sizes:
        raise typer.BadParameter(f"--gpu-memory takes a size or a comma list of sizes, got {text!r}")
    for size in sizes:
        byte_size(size)  # refuses a bad size with a BadParameter naming it
    return sizes


def _store_master(value: str | None) -> str | None:
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise typer.BadParameter(f"--store-master takes host:port of a mooncake_master, got {value!r}")
    return value


def _aligned(tiers: TierConfig | None, window_align: int | None, block: int, page_size: int) -> TierConfig | None:
    """``tiers`` with windows also written at node ends aligned to ``window_align`` (None: the
    trace's ``block`` when the page size divides it, else 0); ``typer.BadParameter`` when the
    value does not fit the other options."""
    if window_align is None:
        window_align = block if block % page_size == 0 else 0
    elif window_align % page_size:
        raise typer.BadParameter(f"--window-align must be a multiple of the page size {page_size}, got {window_align}")
    elif tiers is None and window_align:
        raise typer.BadParameter("--window-align needs tiers below the device (--host-memory or --store)")
    return dataclasses.replace(tiers, window_align=window_align) if tiers is not None else None


def _tiers(
    host_memory: str | None,
    store: str,
    store_memory: str | None,
    store_master: str | None,
    write_policy: str,
    window_stride: int,
    page_size: int,
    host_gbps: float,
    store_gbps: float,
) -> TierConfig | None:
    """The tier layer the options ask for (None: the device only); ``typer.BadParameter`` naming
    an option that does not fit the others."""
    from hybridkv.replay.tiered import STORES, TierConfig

    if store not in STORES:
        raise typer.BadParameter(f"--store takes one of {', '.join(STORES)}, got {store!r}")
    if write_policy not in ("back", "through"):
        raise typer.BadParameter(f"--write-policy takes back or through, got {write_policy!r}")
    if store == "none" and (store_memory is not None or store_master is not None):
        raise typer.BadParameter("--store-memory and --store-master need --store sim or mooncake")
    if store_master is not None and store != "mooncake":
        raise typer.BadParameter("--store-master names a mooncake_master: it needs --store mooncake")
    if window_stride % page_size:
        raise typer.BadParameter(
            f"--window-stride must be a multiple of the page size {page_size}, got {window_stride}"
        )
    if host_memory is None and store == "none":
        if window_stride:
            raise typer.BadParameter("--window-stride needs tiers below the device (--host-memory or --store)")
        return None
    return TierConfig(
        host_memory=host_memory,
        store=store,
        store_memory=store_memory,
        store_master=store_master,
        write_policy=write_policy,
        window_stride=window_stride,
        host_bandwidth=host_gbps * 1e9,
        store_bandwidth=store_gbps * 1e9,
    )


def _placements(specs: list[str] | None, page_size: int) -> list[str]:
    from hybridkv.cache.placement import DEFAULT, CheckpointPlacement, PlacementError

    try:
        return [CheckpointPlacement.parse(s, page_size).spec for s in specs or [DEFAULT]]
    except PlacementError as exc:
        raise typer.BadParameter(f"--checkpoints: {exc}") from None


@app.command("replay")
def replay(
    trace: str = typer.Option(
        ...,
        "--trace",
        help="Mooncake .jsonl(.gz), peer_trace .json(.gz) (radix part), or built-in mooncake-conversation / peer.",
    ),
    model: str = typer.Option(
        ..., "--model", callback=preset, help="Model preset name (e.g. Qwen3-Next-80B-A3B-Instruct)."
    ),
    gpu_memory: str = typer.Option(
        ..., "--gpu-memory", help="KV budget of one device, e.g. 40GiB; a comma list sweeps (20GiB,40GiB,...)."
    ),
    page_size: int = typer.Option(16, "--page-size", min=1),
    policy: str = typer.Option("lru", "--policy", help="lru, lfu, priority, cost; comma list or 'all' to compare."),
    checkpoints: list[str] = typer.Option(
        None,
        "--checkpoints",
        help="State checkpoint placement: none, or a comma list of interval:N, prompt-aligned[:K], branch, end; "
        "repeat the option to compare placements (default: prompt-aligned,branch,end).",
    ),
    max_checkpoints_per_path: int = typer.Option(
        8, "--max-checkpoints-per-path", min=1, help="Most state checkpoints on one root-to-leaf path."
    ),
    cache_tokens: str = typer.Option(
        "inf", "--cache-tokens", help="Cache size cap in tokens (held once requests unlock), or 'inf'."
    ),
    limit: int = typer.Option(None, "--limit", min=1, help="Replay only the first N requests."),
    prefill_tps: float = typer.Option(
        50_000.0, "--prefill-tps", callback=positive_finite, help="Simulated prefill tokens per second."
    ),
    decode_step_ms: float = typer.Option(
        25.0, "--decode-step-ms", callback=positive_finite, help="Simulated time of one decode step."
    ),
    max_running: int = typer.Option(128, "--max-running", min=1, help="Most requests decoding at once."),
    host_memory: str = typer.Option(
        None,
        "--host-memory",
        callback=byte_size,
        help="Host memory below the device for KV and state (e.g. 512GiB): what the device evicts goes there.",
    ),
    store: str = typer.Option(
        "none",
        "--store",
        help="A store below host memory: none, sim (simulated, sizes only: for sweeps) or mooncake (the real "
        "Mooncake Store; a master is started on 127.0.0.1 unless --store-master names one).",
    ),
    store_memory: str = typer.Option(
        None,
        "--store-memory",
        callback=byte_size,
        help="The store's capacity: sim: default unbounded; mooncake: the segment this client mounts (default 1GiB).",
    ),
    store_master: str = typer.Option(
        None, "--store-master", callback=_store_master, help="host:port of an existing mooncake_master."
    ),
    write_policy: str = typer.Option(
        "back",
        "--write-policy",
        help="back: write on device eviction (host evictions go to the store); through: at once.",
    ),
    window_stride: int = typer.Option(
        0,
        "--window-stride",
        min=0,
        help="Sliding-window pages written below the device: before each cached node's end, and before every "
        "multiple of this many tokens (0: node ends only).",
    ),
    window_align: int = typer.Option(
        None,
        "--window-align",
        min=0,
        help="Sliding-window pages written before each node's end rounded down to a multiple of this many "
        "tokens instead of before its end: where a later prompt's hit ends when prompts share content only in "
        "whole blocks (default: the trace's block, 512 for a Mooncake trace when the page size divides it; 0: "
        "node ends).",
    ),
    host_gbps: float = typer.Option(
        25.0, "--host-gbps", callback=positive_finite, help="Host memory -> device bandwidth for load-back time, GB/s."
    ),
    store_gbps: float = typer.Option(
        10.0, "--store-gbps", callback=positive_finite, help="Store -> device bandwidth for load-back time, GB/s."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    plot: str = typer.Option(
        None,
        "--plot",
        help="Write a PNG: hit rate vs memory when --gpu-memory sweeps, else the pool split over time.",
    ),
) -> None:
    """Simulate serving a trace: hit rate (overall and per component), evictions, concurrency.

    One run per memory size, policy and checkpoint placement."""
    memories = _memories(gpu_memory)
    cap = _cache_tokens(cache_tokens)
    from hybridkv.replay import (
        EngineModel,
        ReplayConfig,
        build_report,
        compare,
        load_workload,
        plot_hit_vs_memory,
        plot_pool_split,
    )
    from hybridkv.replay.simulator import ReplayError, Simulator
    from hybridkv.tiers import TierError

    policies = _policies(policy)
    placements = _placements(checkpoints, page_size)
    tiers = _tiers(
        host_memory, store, store_memory, store_master, write_policy, window_stride, page_size, host_gbps, store_gbps
    )
    workload = load_workload(trace, limit=limit)
    tiers = _aligned(tiers, window_align, workload.shared_block_tokens, page_size)
    engine = EngineModel(prefill_tokens_per_s=prefill_tps, decode_step_s=decode_step_ms / 1000, max_running=max_running)
    reports = []
    console = Console(stderr=True)
    runs = [(m, p, c) for m in memories for p in policies for c in placements]
    for memory, name, placement in runs:
        config = ReplayConfig(
            model,
            memory,
            page_size,
            name,
            cap,
            max_checkpoints_per_path,
            checkpoints=placement,
            engine=engine,
            tiers=tiers,
        )
        try:
            sim = Simulator(workload, config)
        except TierError as exc:  # e.g. no mooncake_master at --store-master
            raise ReplayError(str(exc)) from None
        with Progress(
            TextColumn(f"replay [{memory} {name} {placement}]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=as_json,
        ) as bar:
            task = bar.add_task("requests", total=len(workload.requests))

            def progress(done: int, _total: int, task: TaskID = task) -> None:
                bar.update(task, completed=done)

            result = sim.run(progress)
        reports.append(build_report(result))
    out: dict[str, Any] = {"runs": reports, "comparison": compare(reports)}
    if plot:
        sweep = len(memories) > 1
        out["plot"] = str(plot_hit_vs_memory(reports, plot) if sweep else plot_pool_split(reports, plot))
    if as_json:
        typer.echo(json.dumps(out))
        return
    _print_replay(out)


def _print_replay(out: dict[str, Any]) -> None:
    console = Console(width=max(Console().width, 120))
    first = out["runs"][0]
    memories = ", ".join(dict.fromkeys(str(r["gpu_memory"]) for r in out["runs"]))
    console.print(
        f"[bold]{first['model']}[/] on {first['workload']}: {first['requests']:,} requests, "
        f"{first['input_tokens']:,} input tokens, {memories} KV, page size {first['page_size']}, "
        f"cache cap {first['cache_tokens']}"
    )
    table = Table(title="hit rate (tokens) by component rules")
    cols = ("memory", "policy", "checkpoints", "full only", "full+SWA", "full+state", "all (served)")
    for col in (*cols, "SWA cost", "state cost", "recomputed", "ckpt GiB peak/end"):
        table.add_column(col)
    for r in out["runs"]:
        rate, cost, ck = r["hit_rate_by_component"], r["validity_cost"], r["checkpoints"]
        table.add_row(
            str(r["gpu_memory"]),
            r["policy"],
            ck["placement"],
            f"{rate['full_only']:.4f}",
            f"{rate['full+swa']:.4f}",
            f"{rate['full+state']:.4f}",
            f"[bold]{rate['all']:.4f}[/]",
            f"{cost['swa']:.4f}",
            f"{cost['state']:.4f}",
            f"{r['recomputed_tokens']:,}",
            f"{ck['peak_bytes'] / 2**30:.1f} / {ck['end_bytes'] / 2**30:.1f}",
        )
    console.print(table)
    table = Table(title="evictions, concurrency, speed")
    cols = ("memory", "policy", "checkpoints", "full pages", "SWA tombstoned", "states", "retracted")
    for col in (*cols, "peak running", "peak pages", "req/s", "sim s / s"):
        table.add_column(col)
    for r in out["runs"]:
        ev, sp = r["evictions"], r["speed"]
        table.add_row(
            str(r["gpu_memory"]),
            r["policy"],
            r["checkpoints"]["placement"],
            f"{ev['full_pages']:,}",
            f"{sum(ev['window_pages_tombstoned'].values()):,}",
            f"{ev['states']:,}",
            str(r["retractions"]),
            str(r["peak_running"]),
            f"{r['peak_live_pages']:,}",
            f"{sp['requests_per_s']:,.0f}",
            f"{sp['simulated_s_per_wall_s']:,.0f}",
        )
    console.print(table)
    if any("tiers" in r for r in out["runs"]):
        _print_tiers(out)
    if "plot" in out:
        console.print(f"plot: {out['plot']}")


def _print_tiers(out: dict[str, Any]) -> None:
    console = Console(width=max(Console().width, 120))
    table = Table(title="tiers below the device: hit rate by where each component came from")
    cols = ("memory", "tiers", "hit (device only)", "component", "device", "host", "store")
    for col in (*cols, "GB loaded host/store", "load s (per restored token)", "misses"):
        table.add_column(col)
    for r in out["runs"]:
        t = r.get("tiers")
        if not t:
            continue
        loaded = t["bytes_loaded"]
        first = True
        for comp, split in t["hit_rate_by_component_and_tier"].items():
            table.add_row(
                str(r["gpu_memory"]) if first else "",
                t["config"] if first else "",
                f"[bold]{t['hit_rate']:.4f}[/] ({t['device_hit_rate']:.4f})" if first else "",
                comp,
                f"{split['device']:.4f}",
                f"{split['host']:.4f}",
                f"{split['store']:.4f}",
                f"{loaded.get('host', 0) / 1e9:,.1f} / {loaded.get('store', 0) / 1e9:,.1f}" if first else "",
                f"{t['load_seconds']:.2f} ({t['load_seconds_per_restored_token'] * 1e6:.2f} us)" if first else "",
                ", ".join(f"{k} {v}" for k, v in t["misses"].items()) or "none" if first else "",
            )
            first = False
    console.print(table)
