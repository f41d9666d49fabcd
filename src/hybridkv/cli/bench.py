"""``hybridkv bench ...``: every benchmark, each side by side with a baseline in the same run.

``memory``: allocator replay of the peer trace vs static pools; ``cache``: the peer trace's radix
protocol vs a page-hash cache; ``transfer``: GB/s vs raw memcpy / raw Mooncake; ``engine``: engine
tokens/s vs transformers ``generate`` (one by one, padded batches, continuous batching) and hybridkv's
share; ``bf16``: the engine in bf16 on the CPU with and without its fast paths. The runs live in
``hybridkv.bench``; this module parses options and renders tables.
"""

from __future__ import annotations

import json
import math
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from hybridkv.cli.app import bench_app
from hybridkv.cli.params import (
    CHECKPOINTS_HELP,
    DTYPE,
    MAX_STEP_TOKENS,
    TRANSPORT_CHOICES,
    device_option,
    engine_checkpoints,
    random_model,
    transport_option,
)
from hybridkv.cli.sizing import CHUNK_SIZE, GPU_MEMORY, MAX_CONTEXT, PAGE_SIZE, Layout, Sizing, size
from hybridkv.engine.random_models import MAX_WIDEN, tiny_names
from hybridkv.traces import PEER_TRACE
from hybridkv.units import format_bytes


@bench_app.command("memory")
def bench_memory(
    trace: str = typer.Option(
        PEER_TRACE, "--trace", help='peer_trace.json (plain or .gz), or the built-in name "peer".'
    ),
    page_size: int = typer.Option(16, "--page-size", min=1),
    config: list[str] = typer.Option(None, "--config", help="full, full+swa, full+state (repeatable)."),
    device: str = typer.Option(
        "meta",
        "--device",
        callback=device_option(("meta", "cpu", "cuda")),
        help="meta: tables only; cpu or cuda: a real arena and the baseline's tensors there.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Calls/s, p50/p99 per op and host syncs, side by side with a static-pool baseline."""
    from hybridkv.bench.memory import run

    report = run(trace, page_size, config, device)
    if as_json:
        typer.echo(json.dumps(report))
        return
    console = Console()
    for name, res in report["configs"].items():
        table = Table(title=f"{name} ({res['model']}), page size {report['page_size']}, 1 torch thread")
        for col in ("allocator", "calls", "calls/s", "host syncs", "op", "p50 us", "p99 us"):
            table.add_column(col)
        for label in ("hybridkv", "static_baseline"):
            r = res[label]
            first = True
            for op, s in r["ops"].items():
                table.add_row(
                    label if first else "",
                    f"{r['calls']:,}" if first else "",
                    f"{r['calls_per_s']:,.0f}" if first else "",
                    str(r["host_syncs"]) if first else "",
                    op,
                    f"{s['p50_us']:.1f}",
                    f"{s['p99_us']:.1f}",
                )
                first = False
        console.print(table)
        console.print(f"  hybridkv / baseline calls/s: [bold]{res['speedup_vs_baseline']:.2f}x[/]")


@bench_app.command("cache")
def bench_cache(
    trace: str = typer.Option(
        PEER_TRACE, "--trace", help='peer_trace.json (plain or .gz), or the built-in name "peer".'
    ),
    page_size: int = typer.Option(16, "--page-size", min=1),
    config: list[str] = typer.Option(None, "--config", help="full, full+swa (repeatable)."),
    repeat: int = typer.Option(3, "--repeat", min=1, help="Timed passes per run; the fastest is reported."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Match / insert / evict ops/s and p50/p99 of the prefix cache vs a page-hash baseline."""
    from hybridkv.bench.cache import run

    report = run(trace, page_size, config, repeat)
    if as_json:
        typer.echo(json.dumps(report))
        return
    console = Console(width=max(Console().width, 120))
    table = Table(title=f"bench cache: {report['requests']:,} radix requests, page size {page_size}")
    cols = ("config", "pool", "cache", "hit rate", "evicted pages", "op", "ops/s", "p50 us", "p99 us")
    for col in (*cols, "x baseline"):
        table.add_column(col)
    ratios = {(r["config"], r["pool"]): r for r in report["ratios"]}
    for run_ in report["runs"]:
        first = True
        for op, s in run_["ops"].items():
            ratio = ratios[(run_["config"], run_["pool"])].get(op) if run_["impl"] == "hybridkv" else None
            table.add_row(
                run_["config"] if first else "",
                run_["pool"] if first else "",
                run_["impl"] if first else "",
                f"{run_['hit_rate']:.4f}" if first else "",
                f"{run_['evicted_pages']:,}" if first else "",
                op,
                f"{s['ops_per_s']:,.0f}",
                f"{s['p50_us']:.1f}",
                f"{s['p99_us']:.1f}",
                f"{ratio:.2f}x" if ratio is not None and not math.isnan(ratio) else "",
            )
            first = False
    console.print(table)
    exact = report["exact_hit_rate"]
    console.print(
        f"unbounded hit rate at page size 1: hybridkv {exact['hybridkv']:.6f}, baseline "
        f"{exact['page_hash_baseline']:.6f} (goal {exact['goal']})"
    )
    for name, goal in report["goals"].items():
        mark = "[green]met[/]" if goal["met"] else "[red]not met[/]"
        value = f"{goal['value']:.4f}" if goal["value"] < 1 else f"{goal['value']:,.0f}"
        console.print(f"goal {name}: {value} (goal {goal['goal']:,}) -> {mark}")


@bench_app.command("transfer")
def bench_transfer(
    transport: str = typer.Option("shm", "--transport", help=f"{TRANSPORT_CHOICES}.", callback=transport_option),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    reps: int = typer.Option(7, "--reps", help="Timed repetitions per case (median).", min=1, max=1000),
    page_tokens: list[int] = typer.Option(
        None, "--page-tokens", help="Tokens per page (16 KiB each).", min=1, max=1024
    ),
    batch: list[int] = typer.Option(None, "--batch", help="Pages per request.", min=1, max=4096),
) -> None:
    """GB/s by page size and batch size, side by side with raw memcpy / raw Mooncake."""
    from hybridkv.bench.transfer import run

    kwargs: dict[str, Any] = {"transport": transport, "reps": reps}
    if page_tokens:
        kwargs["page_tokens"] = tuple(page_tokens)
    if batch:
        kwargs["batches"] = tuple(batch)
    report = run(**kwargs)
    if as_json:
        typer.echo(json.dumps(report))
        return
    table = Table(title=f"transfer over {transport}: hybridkv vs {report['baseline']} (median of {reps})")
    block = any(r["memcpy_block_gbps"] is not None for r in report["cases"])  # a copy transport's bound
    cols = ["page", "batch", "bytes", "ops", "hybridkv GB/s", "raw GB/s", "ratio", "overhead µs", "plan µs"]
    cols += ["prepare µs"]
    cols += ["block memcpy GB/s", "ratio to block"] if block else []
    for col in [*cols, "end-to-end GB/s", "goal"]:
        table.add_column(col, justify="right")
    for r in report["cases"]:
        verdict = "" if r["goal"] is None else ("met" if r["meets_goal"] else "MISSED") + f" (>= {r['goal']})"
        row = [
            format_bytes(r["page_bytes"]),
            str(r["batch"]),
            format_bytes(r["bytes"]),
            str(r["ops"]),
            f"{r['hybridkv_gbps']:.2f}",
            "-" if r["baseline_gbps"] is None else f"{r['baseline_gbps']:.2f}",
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
            "-" if r["overhead_us"] is None else f"{r['overhead_us']:.0f}",
            f"{r['plan_us']:.0f}",
            f"{r['prepare_us']:.0f}",
        ]
        if block:
            row += [f"{r['memcpy_block_gbps']:.2f}", f"{r['ratio_to_block']:.2f}"]
        table.add_row(*row, f"{r['end_to_end_gbps']:.2f}", verdict)
    console = Console(width=160)
    console.print(table)
    if report["goal"] is None:
        console.print(f"goal: none (baseline: {report['baseline']})")
    else:
        console.print(f"goal: {report['goal']}: {'met' if report['meets_goal'] else 'not met in every case'}")


@bench_app.command("engine")
def bench_engine(
    model: list[str] = typer.Option(None, "--model", help="A tiny random model (repeatable; default: all five)."),
    requests: int = typer.Option(64, "--requests", min=1),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", min=1),
    block_tokens: int = typer.Option(4, "--block-tokens", min=1, help="Tokens per 512-token trace block."),
    gpu_memory: str | None = GPU_MEMORY,
    max_context: int | None = MAX_CONTEXT,
    page_size: int = PAGE_SIZE,
    chunk_size: int = CHUNK_SIZE,
    max_step_tokens: int | None = MAX_STEP_TOKENS,
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Serve without the prefix cache."),
    checkpoints: str | None = typer.Option(None, "--checkpoints", help=CHECKPOINTS_HELP),
    device: str = typer.Option(
        "cpu",
        "--device",
        callback=device_option(("cpu", "cuda")),
        help="Where the engine's weights and memory live (transformers runs on the CPU).",
    ),
    rounds: int = typer.Option(3, "--rounds", min=1, max=50, help="Alternating rounds; each contender's best is kept."),
    padded_batch: int = typer.Option(16, "--padded-batch", min=1, help="Requests per left-padded generate batch."),
    compile_blocks: bool = typer.Option(
        False, "--compile", help="Also run an engine whose blocks are compiled (torch.compile; slow to start)."
    ),
    widen: int = typer.Option(
        1,
        "--widen",
        min=1,
        max=MAX_WIDEN,
        help="Multiply every width of the tiny models (hidden, MLP, head and state dims; 2: hidden 128); "
        "head counts, layers, experts and windows stay.",
    ),
    dtype: str = DTYPE,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Mooncake conversations scaled down, served by the engine and by transformers (one by one, left-padded
    batches with sdpa, continuous batching), alternating rounds in one run."""
    models = model or tiny_names()
    unknown = sorted(set(models) - set(tiny_names()))
    if unknown:
        raise typer.BadParameter(f"unknown models {unknown}; choose from {tiny_names()}", param_hint="--model")
    from hybridkv.bench.engine import bench_prompts, run

    checkpoints = engine_checkpoints(checkpoints, chunk_size, page_size)
    lengths = [len(p) for p in bench_prompts(requests, block_tokens, max_new_tokens)]
    sizing = max(
        (
            _size_tiny(
                "bench engine",
                m,
                lengths,
                max_new_tokens,
                max_context,
                gpu_memory,
                page_size,
                chunk_size,
                device=device,
                widen=widen,
                dtype=dtype,
            )
            for m in models
        ),
        key=lambda s: s.gpu_memory,
    )
    sizing.announce()
    report = run(
        models,
        requests,
        max_new_tokens,
        block_tokens,
        sizing.gpu_memory,
        page_size,
        chunk_size,
        not no_prefix_cache,
        checkpoints,
        rounds,
        padded_batch,
        max_step_tokens,
        compile_blocks,
        sizing.max_context,
        device,
        widen,
        dtype,
    )
    if as_json:
        typer.echo(json.dumps(report))
        return
    lengths = report["prompt_tokens"]
    console = Console(width=max(Console().width, 140))
    cols = ("contender", "wall s", "CPU s", "tok/s", "tok/CPU s", "computed", "CPU µs/computed", "hybridkv share")
    for r in report["models"]:
        table = Table(
            title=f"{r['model']}{_widened(report['widen'])} {report['dtype']}: {report['requests']} requests, prompts "
            f"{lengths['min']}-{lengths['max']} tokens (mean {lengths['mean']}), {report['max_new_tokens']} new each, "
            f"best of {report['rounds']} alternating rounds, 1 torch thread, HF attention {r['hf_attention']}"
        )
        for col in (*cols, "exact"):
            table.add_column(col, justify="left" if col == "contender" else "right")
        for label, c in r["contenders"].items():
            share = f"{100 * c['hybridkv_share']:.1f}%" if "hybridkv_share" in c else ""
            table.add_row(
                label,
                f"{c['wall_s']:.2f}",
                f"{c['cpu_s']:.2f}",
                f"{c['tokens_per_s']:,.0f}",
                f"{c['tokens_per_cpu_s']:,.0f}",
                f"{c['computed_tokens']:,}",
                f"{c['cpu_us_per_computed']:.0f}",
                share,
                f"{c['exact']}/{report['requests']}",
            )
        console.print(table)
        for label, why in r["not_run"].items():
            console.print(f"  {label} does not run here: {why}")
        if r["compile_s"] is not None:
            console.print(f"  engine_compiled: its first pass (compiling every step shape) took {r['compile_s']} s")
        goals = report["goals"]
        verdict = {True: "met", False: "NOT met"}
        console.print(
            f"  engine tok/CPU s = {r['speedup_vs_strongest']:.2f}x {r['strongest_baseline']} (goal >= "
            f"{goals['vs_strongest']:.0f}x) {verdict[r['speedup_met']]}; CPU per computed token = "
            f"{r['cpu_per_computed_ratio']:.2f}x {r['cheapest_padded']} (goal <= {goals['cpu_per_computed_ratio']}x) "
            f"{verdict[r['cpu_met']]}; hybridkv share <= {100 * goals['hybridkv_share']:.0f}% "
            f"{verdict[r['share_met']]}"
        )
        wrapped = r["contenders"]["engine"].get("hybridkv_share_all_wrapped")
        if wrapped is not None:
            console.print(
                f"  hybridkv share timed at the {r['contenders']['engine']['hybridkv_methods_timed']} methods the "
                f"engine calls hybridkv by; with every hybridkv method wrapped it read {100 * wrapped:.1f}%"
            )
        console.print(
            f"  at the same mix ({_mix(r)}): engine CPU = {r['cpu_same_mix_ratio']:.2f}x (goal <= "
            f"{goals['cpu_per_computed_ratio']}x) {verdict[r['cpu_same_mix_met']]}"
        )
        console.print(
            f"  the mix alone: an engine paying exactly {r['cheapest_padded']}'s per-phase prices would read "
            f"{r['plain_ratio_at_hf_prices']:.2f}x per computed token"
        )
        if len(r["speedup_rounds"]) > 1:  # how much the machine moved the ratios (the verdicts take the best passes)
            console.print(
                f"  round by round: tok/CPU s {_spread(r['speedup_rounds'])}x, "
                f"CPU per computed token {_spread(r['cpu_ratio_rounds'])}x, "
                f"at the same mix {_spread(r['cpu_same_mix_rounds'])}x"
            )


def _widened(widen: int) -> str:
    return "" if widen == 1 else f" widened {widen}x"


def _mix(row: dict[str, Any]) -> str:
    """The engine's computed tokens per phase and the padded pass's price of each (a phase without tokens left out: a
    pass of one new token per request has no decode)."""
    engine = row["contenders"]["engine"]
    priced = row["contenders"][row["same_mix_padded"]]["cpu_us_per_phase_position"]
    tokens = {"prefill": engine["computed_tokens"] - engine["decode_tokens"], "decode": engine["decode_tokens"]}
    said = [f"{n:,} {phase} tokens at {priced[phase]:.0f} µs" for phase, n in tokens.items() if n]
    return " and ".join(said) + f", {row['same_mix_padded']}'s prices"


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _size_tiny(
    command: str,
    name: str,
    lengths: list[int],
    max_new_tokens: int,
    max_context: int | None,
    gpu_memory: str | None,
    page_size: int,
    chunk_size: int,
    layout: Layout | None = None,
    device: str = "cpu",
    widen: int = 1,
    dtype: str = "float32",
) -> Sizing:
    """``size`` for the tiny random model ``name`` (its widths times ``widen``) in ``dtype`` serving prompts of
    ``lengths`` on ``device``."""
    import torch

    from hybridkv.engine.random_models import random_config
    from hybridkv.engine.registry import engine_spec

    spec = engine_spec(random_config(name, widen), getattr(torch, dtype))
    return size(
        command,
        spec,
        prompt_lengths=lengths,
        max_new_tokens=max_new_tokens,
        max_context=max_context,
        gpu_memory=gpu_memory,
        page_size=page_size,
        chunk_size=chunk_size,
        layout=layout,
        device=device,
    )


@bench_app.command("bf16")
def bench_bf16(
    model: list[str] = typer.Option(
        None, "--model", help="A tiny random model (repeatable; default: tiny-gemma3 and tiny-qwen3-next)."
    ),
    widen: int = typer.Option(8, "--widen", min=1, max=MAX_WIDEN, help="Multiply every width of the tiny models."),
    workload: list[str] = typer.Option(
        None, "--workload", help="prefill-heavy, decode-heavy (repeatable; default: both)."
    ),
    rounds: int = typer.Option(3, "--rounds", min=1, max=50, help="Alternating rounds; each contender's best is kept."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The engine in bf16 on the CPU with its fast paths (packed bf16 linears, in-place recurrent decode states) and
    without them, alternating rounds in one run: CPU seconds and new tokens per CPU second."""
    from hybridkv.bench.bf16_cpu import WORKLOADS, run

    models = model or ["tiny-gemma3", "tiny-qwen3-next"]
    unknown = sorted(set(models) - set(tiny_names()))
    if unknown:
        raise typer.BadParameter(f"unknown models {unknown}; choose from {tiny_names()}", param_hint="--model")
    odd = sorted(set(workload or []) - set(WORKLOADS))
    if odd:
        raise typer.BadParameter(f"unknown workloads {odd}; choose from {list(WORKLOADS)}", param_hint="--workload")
    report = run(models, widen, rounds, workload or None)
    if as_json:
        typer.echo(json.dumps(report))
        return
    table = Table(
        title=f"bench bf16: the engine in bf16 on the CPU{_widened(widen)}, with ({report['fast_paths']}) and "
        f"without its fast paths, best of {rounds} alternating rounds, 1 torch thread"
    )
    for col in ("model", "workload", "contender", "CPU s", "new tok/CPU s", "CPU µs/new tok", "speedup", "same"):
        table.add_column(col, justify="left" if col in ("model", "workload", "contender") else "right")
    for row in report["rows"]:
        shape = f"{row['requests']} x {row['prompt_tokens']} + {row['new_tokens']}"
        for label, c in row["contenders"].items():
            table.add_row(
                row["model"],
                f"{row['workload']} ({shape})",
                label,
                f"{c['cpu_s']:.3f}",
                f"{c['tokens_per_cpu_s']:,.0f}",
                f"{c['cpu_us_per_token']:,.0f}",
                f"{row['speedup']:.2f}x ({row['fused_gain']:.2f}x unfused)" if label == "fast" else "",
                f"{c['same']}/{row['requests']}",
            )
    Console(width=max(Console().width, 140)).print(table)


@bench_app.command("pd")
def bench_pd(
    model: str = typer.Option("tiny-qwen3-next", "--model", callback=random_model, help="A tiny random model."),
    requests: int = typer.Option(16, "--requests", min=1, max=64),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens", min=1),
    transport: str = typer.Option("shm", "--transport", help=f"{TRANSPORT_CHOICES}.", callback=transport_option),
    prefill_pp: int = typer.Option(2, "--prefill-pp", min=1, help="Prefill pipeline stages."),
    prefill_tp: int = typer.Option(1, "--prefill-tp", min=1, help="Tensor-parallel ranks per prefill stage."),
    decode_tp: int = typer.Option(2, "--decode-tp", min=1, help="Decode tensor-parallel ranks."),
    block_tokens: int = typer.Option(4, "--block-tokens", min=1, help="Tokens per 512-token trace block."),
    gpu_memory: str | None = GPU_MEMORY,
    max_context: int | None = MAX_CONTEXT,
    page_size: int = PAGE_SIZE,
    chunk_size: int = CHUNK_SIZE,
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Serve both sides without one."),
    dtype: str = DTYPE,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Disaggregated serving vs single-process serving of the same requests: bytes vs the spec, transfer
    seconds and GB/s, overlap of transfer and prefill compute, TTFT ratio."""
    from hybridkv.bench.pd import pd_prompts, run

    lengths = [len(p) for p in pd_prompts(requests, block_tokens, max_new_tokens)]
    layout = Layout(prefill_pp, prefill_tp, decode_tp)
    sizing = _size_tiny(
        "bench pd", model, lengths, max_new_tokens, max_context, gpu_memory, page_size, chunk_size, layout, dtype=dtype
    )
    sizing.announce()
    report = run(
        model,
        requests,
        max_new_tokens,
        transport,
        prefill_pp,
        prefill_tp,
        decode_tp,
        block_tokens,
        page_size,
        chunk_size,
        not no_prefix_cache,
        gpu_memory=sizing.gpu_memory,
        max_context=sizing.max_context,
        dtype=dtype,
    )
    if as_json:
        typer.echo(json.dumps(report))
        return
    cache = "on" if report["prefix_cache"] else "off"
    table = Table(
        title=f"{model} ({dtype}): prefill PP {prefill_pp} x TP {prefill_tp} -> decode TP {decode_tp} over "
        f"{transport} vs one process, {requests} requests, {max_new_tokens} new each, prefix cache {cache}"
    )
    cols = ["request", "prompt", "cached PD/1", "bytes per decode rank", "= spec", "transfer ms", "GB/s"]
    cols += ["ops", "µs/op", "overlap", "other stage"]
    for col in (*cols, "TTFT PD ms", "TTFT 1-proc ms", "PD/1-proc", "exact"):
        table.add_column(col, justify="left" if col in ("request", "bytes per decode rank") else "right")
    for i, r in enumerate(report["per_request"]):
        table.add_row(
            str(i),
            str(r["prompt_tokens"]),
            f"{r['cached_tokens_pd']}/{r['cached_tokens_single']}",
            " + ".join(format_bytes(b) for b in r["transfer_bytes_per_rank"]),
            "yes" if r["bytes_match"] else "[red]NO[/]",
            f"{r['transfer_s'] * 1e3:.1f}",
            "" if r["gbps"] is None else f"{r['gbps']:.3f}",
            str(r["ops"]),
            "" if r["send_us_per_op"] is None else f"{r['send_us_per_op']:.0f}",
            f"{100 * r['overlap_ratio']:.0f}%",
            f"{100 * r['overlap_other_stage_ratio']:.0f}%",
            f"{r['ttft_pd_s'] * 1e3:.1f}",
            f"{r['ttft_single_s'] * 1e3:.1f}",
            f"{r['ttft_ratio']:.2f}x",
            "yes" if r["exact"] else "[red]NO[/]",
        )
    console = Console(width=max(Console().width, 150))
    console.print(table)
    t = report["totals"]
    gbps = "n/a" if t["gbps"] is None else f"{t['gbps']:.3f} GB/s"
    console.print(
        f"total {format_bytes(t['transfer_bytes'])} moved (spec {format_bytes(t['spec_bytes'])}) in "
        f"{t['transfer_s'] * 1e3:.1f} ms of sending: {gbps}, {t['ops']} write ops ({t['send_us_per_op']} µs of a "
        f"send window each); {100 * t['overlap_ratio']:.0f}% of send time overlaps "
        f"prefill compute ({100 * t['overlap_other_stage_ratio']:.0f}% another stage's); "
        f"{t['exact']}/{requests} token-exact"
    )
    console.print(
        f"burst of {requests}: mean TTFT {t['ttft_pd_mean_s'] * 1e3:.1f} ms disaggregated vs "
        f"{t['ttft_single_mean_s'] * 1e3:.1f} ms single-process (+{t['ttft_extra_ms']:.1f} ms; goal <= handoff "
        f"{t['handoff_mean_ms']:.1f} + 10 ms: {'met' if t['ttft_goal_met'] else 'NOT met'}); prefill "
        f"{t['prefill_tokens_per_s_pd']:.0f} vs {t['prefill_tokens_per_s_single']:.0f} tokens/s "
        f"({t['prefill_throughput_ratio']:.2f}x; goal >= 0.8x); alone (cached prompt): mean TTFT "
        f"{t['alone_ttft_pd_mean_s'] * 1e3:.1f} vs {t['alone_ttft_single_mean_s'] * 1e3:.1f} ms "
        f"(+{t['alone_ttft_extra_ms']:.1f} ms)"
    )
