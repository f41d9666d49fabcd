"""``hybridkv bench transfer`` and ``hybridkv transfer-plan``: transfer benchmark and plan inspection.

Options are checked before any work (typer ranges, ``transport_option``); a request too
large to inspect is refused with its page count (``MAX_PLAN_PAGES``). Errors go to the
CLI's one error path (``cli.app.main``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from hybridkv.cli.app import app, bench_app
from hybridkv.memory import LayoutError, MemoryHints, UnifiedMemory, build_layouts, format_bytes, plan_memory
from hybridkv.spec import IdSpace, Parallel, ShardSpec, get_preset
from hybridkv.transfer import TransportName, buffer_set_from_memory, memory_cells, pair_entries
from hybridkv.transfer.plan import Route, num_pages
from hybridkv.transfer.transport import transport_class

_FAKE_BASE = 1 << 44  # meta memories have no addresses; each rank gets a made-up base
_RANK_SPAN = 1 << 40
MAX_PLAN_PAGES = 1 << 17
"""Pages of one request that ``transfer-plan`` inspects at most (2M tokens at 16 per page:
seconds and a few hundred MiB)."""
MAX_RANKS = 64


def transport_option(value: str) -> str:
    """A transport name the registry knows (``typer.BadParameter`` naming the known ones)."""
    try:
        transport_class(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


@bench_app.command("transfer")
def bench_transfer(
    transport: str = typer.Option("shm", "--transport", help="shm or mooncake.", callback=transport_option),
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
    block = TransportName(transport) is TransportName.SHM  # only shm has a block-memcpy bound
    cols = ["page", "batch", "bytes", "ops", "hybridkv GB/s", "raw GB/s", "ratio", "overhead µs"]
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
            f"{r['baseline_gbps']:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['overhead_us']:.0f}",
        ]
        if block:
            row += [f"{r['memcpy_block_gbps']:.2f}", f"{r['ratio_to_block']:.2f}"]
        table.add_row(*row, f"{r['end_to_end_gbps']:.2f}", verdict)
    console = Console(width=160)
    console.print(table)
    console.print(f"goal: {report['goal']}: {'met' if report['meets_goal'] else 'not met in every case'}")


def _meta_memory(shard: ShardSpec, page_size: int, seq_len: int) -> UnifiedMemory:
    """A tables-only memory with room for one request of ``seq_len`` tokens."""
    layouts = build_layouts(shard, page_size)
    slot = IdSpace.SLOT
    need = sum(lay.cell_bytes * (1 if lay.id_space is slot else num_pages(seq_len, page_size) + 2) for lay in layouts)
    hints = MemoryHints(page_size=page_size, max_context=seq_len, chunk_tokens=seq_len)
    budget = 4 * need
    while True:
        try:
            return UnifiedMemory(plan_memory(shard, budget, hints), "meta")
        except LayoutError:
            budget *= 2


def transfer_plan_report(
    model: str, prefill_pp: int, prefill_tp: int, decode_tp: int, seq_len: int, page_size: int
) -> dict[str, Any]:
    need = num_pages(seq_len, page_size)
    if need > MAX_PLAN_PAGES:
        raise ValueError(
            f"--seq-len {seq_len} in pages of {page_size} is {need} pages; transfer-plan inspects at most "
            f"{MAX_PLAN_PAGES} pages per request (raise --page-size or lower --seq-len)"
        )
    spec = get_preset(model)
    prefill = {
        (p, t): _meta_memory(ShardSpec(spec, Parallel(prefill_tp, prefill_pp), p, t), page_size, seq_len)
        for p in range(prefill_pp)
        for t in range(prefill_tp)
    }
    legs = []
    for d in range(decode_tp):
        dec = _meta_memory(ShardSpec(spec, Parallel(decode_tp, 1), 0, d), page_size, seq_len)
        dec_bufs = buffer_set_from_memory(dec, _FAKE_BASE)
        pages = dec.alloc_pages(need)
        slot = int(dec.alloc_state(1)[0]) if dec.slot_pools else None
        dst = memory_cells(dec, pages, slot)
        for k, ((p, t), mem) in enumerate(sorted(prefill.items())):
            bufs = buffer_set_from_memory(mem, _FAKE_BASE + (k + 1) * _RANK_SPAN)
            src_pages = mem.alloc_pages(pages.size)
            src_slot = int(mem.alloc_state(1)[0]) if mem.slot_pools else None
            pairs = pair_entries(bufs, dec_bufs)
            plan = Route(bufs, dec_bufs, pairs).plan(seq_len, memory_cells(mem, src_pages, src_slot), dst)
            mem.free_pages(src_pages)
            if src_slot is not None:
                mem.free_state(np.array([src_slot]))
            legs.append(
                {
                    "prefill": [p, t],
                    "decode_tp": d,
                    "layers": sorted({pair.layer_id for pair in pairs}),
                    "pairs": len(pairs),
                    "pieces": plan.pieces,
                    "ops": plan.num_ops,
                    "bytes": plan.nbytes,
                }
            )
    return {
        "model": spec.name,
        "prefill": {"pp": prefill_pp, "tp": prefill_tp},
        "decode": {"tp": decode_tp},
        "seq_len": seq_len,
        "page_size": page_size,
        "legs": legs,
    }


@app.command("transfer-plan")
def transfer_plan(
    model: str = typer.Option(..., "--model", help="Preset name (hybridkv presets)."),
    prefill_pp: int = typer.Option(1, "--prefill-pp", min=1, max=MAX_RANKS),
    prefill_tp: int = typer.Option(1, "--prefill-tp", min=1, max=MAX_RANKS),
    decode_tp: int = typer.Option(1, "--decode-tp", min=1, max=MAX_RANKS),
    seq_len: int = typer.Option(4096, "--seq-len", help="Tokens of the request.", min=1),
    page_size: int = typer.Option(16, "--page-size", min=1, max=1 << 16),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """What each prefill rank sends each decode rank for one request: pairs, ops, bytes."""
    report = transfer_plan_report(model, prefill_pp, prefill_tp, decode_tp, seq_len, page_size)
    if as_json:
        typer.echo(json.dumps(report))
        return
    table = Table(
        title=f"{report['model']}: prefill pp {prefill_pp} tp {prefill_tp} -> decode tp {decode_tp}, "
        f"{seq_len} tokens, pages of {page_size}"
    )
    for col in ("prefill (pp, tp)", "decode tp", "layers", "entry pairs", "pieces", "ops", "bytes"):
        table.add_column(col, justify="right")
    for leg in report["legs"]:
        layers = leg["layers"]
        span = f"{layers[0]}..{layers[-1]} ({len(layers)})" if layers else "-"
        table.add_row(
            str(tuple(leg["prefill"])),
            str(leg["decode_tp"]),
            span,
            str(leg["pairs"]),
            f"{leg['pieces']:,}",
            f"{leg['ops']:,}",
            format_bytes(leg["bytes"]),
        )
    Console().print(table)
