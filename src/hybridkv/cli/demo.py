"""``hybridkv demo`` (``make demo``): a tiny random Qwen3-Next served disaggregated, token-exact against transformers.

The default run: 2 pipeline-stage prefill processes hand KV and GDN state over the Mooncake
transfer engine (TCP) to 2 tensor-parallel decode processes (``engine.disagg.run_pd``), six
shared-prefix requests submitted at once, with one deliberate fault on request ``FAULT_REQUEST``
(``--fault``): ``kill-prefill`` (default) SIGKILLs prefill stage 1 while it sends that request,
``kill-decode`` SIGKILLs decode TP rank 1 while it holds it (either engine restarts and the
request is computed again), ``stall-transfer`` holds its KV back past the decode side's transfer
timeout (it ends Failed). Per request: its tokens next to ``transformers``' greedy tokens, its
status and a verdict, then its prefix-cache hit, bytes moved and timings.

A verdict is right when a request finished with ``transformers``' tokens, except the stalled
request, which must end Failed, and a killed-engine request, which must also show its second
attempt (the fault landed). The command exits 1 unless every verdict is right. ``--all`` first
runs the earlier sections (the planner on real models, a replay of the Mooncake trace, a
byte-checked multi-process transfer, the single-process engine); their checks count too.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hybridkv.cli.app import app
from hybridkv.cli.params import transport_option
from hybridkv.memory import format_bytes

if TYPE_CHECKING:
    from hybridkv.engine.disagg import RequestResult

PD_MODEL = "tiny-qwen3-next"
PD_PREFIX = 40
PD_SUFFIXES = (3, 9, 17, 26, 12, 20)
"""Requests 0-3 share a 40-token prefix, 4 extends request 1 (a conversation's next turn), 5 shares nothing."""
PD_MAX_NEW = 8
FAULT_REQUEST = 2
DEMO_FAULTS = ("kill-prefill", "kill-decode", "stall-transfer", "none")
STALL_TIMEOUT_S = 3.0  # the decode side's transfer timeout when a transfer is stalled (for 2 s longer)

DEMO_MODELS = ["Qwen3-Next-80B-A3B-Instruct", "Gemma-3-27B-IT", "gpt-oss-120b", "Kimi-Linear-48B-A3B-Instruct"]


def _fault_option(value: str) -> str:
    if value not in DEMO_FAULTS:
        raise typer.BadParameter(f"unknown fault {value!r}; choose one of {', '.join(DEMO_FAULTS)}")
    return value


@app.command()
def demo(
    out: Path = typer.Option(Path("out/demo"), "--out", help="Where the JSON report (and the --all PNGs) go."),
    requests: int = typer.Option(
        len(PD_SUFFIXES),
        "--requests",
        min=FAULT_REQUEST + 1,
        max=len(PD_SUFFIXES),
        help="Requests of the disaggregated run.",
    ),
    transport: str = typer.Option("mooncake", "--transport", callback=transport_option, help="mooncake or shm."),
    fault: str = typer.Option(
        "kill-prefill", "--fault", callback=_fault_option, help=f"On request {FAULT_REQUEST}: {', '.join(DEMO_FAULTS)}."
    ),
    all_sections: bool = typer.Option(
        False, "--all", help="Before it: the planner, a trace replay, a byte-checked transfer, the engine."
    ),
    gpu_memory: str = typer.Option("80GiB", "--gpu-memory", help="The planner's GPU (--all)."),
) -> None:
    """A tiny random Qwen3-Next served disaggregated: 2 PP prefill processes -> decode TP 2 processes over
    Mooncake, one deliberate fault, every request's tokens next to transformers' with a verdict, and its
    timings. Exits 1 unless every verdict is right. ``--all`` first runs the earlier sections."""
    console = Console(width=max(Console().width, 150))
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    if all_sections:
        report.update(earlier_sections(console, out, gpu_memory))
        console.rule("5. Disaggregated serving: 2 PP prefill processes -> decode TP 2 processes, vs transformers")
    pd = report["pd"] = pd_section(console, requests, transport, fault)
    (out / "demo.json").write_text(json.dumps(report, indent=1))
    console.print(f"report: {out / 'demo.json'}")
    verdicts = [r["right"] for r in pd["requests"]]
    if all_sections:
        verdicts += [report["pd_transfer"]["ok"], *(r["match"] for r in report["engine"]["requests"])]
    if not all(verdicts):
        raise typer.Exit(1)


def pd_prompts(requests: int) -> list[list[int]]:
    """The disaggregated run's prompts (``PD_SUFFIXES``), seeded."""
    import torch

    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 256, (PD_PREFIX,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in PD_SUFFIXES[:4]]
    prompts.append(prompts[1] + torch.randint(3, 256, (PD_SUFFIXES[4],), generator=g).tolist())
    prompts.append(torch.randint(3, 256, (PD_SUFFIXES[5],), generator=g).tolist())
    return prompts[:requests]


def reference_tokens(hf: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """``transformers`` greedy ``generate``, one prompt at a time, ``max_new`` tokens each (EOS does not stop it)."""
    import torch

    with torch.no_grad():
        return [
            hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=None)[
                0, len(ids) :
            ].tolist()
            for ids in prompts
        ]


def pd_section(console: Console, requests: int, transport: str, fault: str) -> dict[str, Any]:
    """Serve ``pd_prompts(requests)`` with ``run_pd`` (PP 2 -> TP 2, pages of 16, prefill chunks of 16, the
    prefill prefix cache on, ``fault`` on request ``FAULT_REQUEST``) and with ``transformers``; print a row per
    request: tokens side by side, status, verdict; then cache hit, bytes moved, timings."""
    import tempfile

    from hybridkv.engine.disagg import FINISHED, Fault, PDConfig, run_pd
    from hybridkv.engine.random_models import quiet_transformers, save_random
    from hybridkv.engine.request import SamplingParams

    prompts = pd_prompts(requests)
    faults: tuple[Fault, ...] = ()
    timeout = 30.0
    if fault == "stall-transfer":
        faults, timeout = (Fault(fault, FAULT_REQUEST, delay_s=STALL_TIMEOUT_S + 2),), STALL_TIMEOUT_S
    elif fault != "none":
        faults = (Fault(fault, FAULT_REQUEST, rank=1, delay_s=5.0),)  # kill-prefill: its writes slowed, killed mid-way
    with tempfile.TemporaryDirectory(prefix="hybridkv-demo-") as model_dir:
        hf = save_random(PD_MODEL, model_dir)
        config = PDConfig(
            model_dir,
            tuple(map(tuple, prompts)),
            PD_MAX_NEW,
            prefill_pp=2,
            decode_tp=2,
            transport=transport,
            chunk=16,
            transfer_timeout_s=timeout,
            faults=faults,
        )
        started = time.monotonic()
        # as many tokens as the reference; the requests before the faulted one alone, one at a time (the later
        # ones hit their prefix in the prefill cache), then the rest at once
        result = run_pd(config, SamplingParams(PD_MAX_NEW, ignore_eos=True), alone_first=FAULT_REQUEST)
        wall = time.monotonic() - started
    with quiet_transformers():
        reference = reference_tokens(hf, prompts, PD_MAX_NEW)
    tokens = Table(
        title=f"{PD_MODEL}: prefill PP {config.prefill_pp} (one process per stage) -> decode TP {config.decode_tp} "
        f"(one process per rank) over {transport}, {PD_MAX_NEW} greedy tokens each, vs transformers generate; "
        f"fault on request {FAULT_REQUEST}: {fault}"
    )
    for col in ("request", "prompt tokens", "disaggregated", "transformers", "status", "verdict"):
        tokens.add_column(col, no_wrap=True)
    timings = Table(title="per request: prefill prefix-cache hit, bytes moved to both decode ranks, ms")
    for col in ("request", "cached", "moved", "queue", "prefill", "transfer", "decode", "TTFT", "TPOT"):
        timings.add_column(col, justify="left" if col == "request" else "right")
    rows: list[dict[str, Any]] = []
    for i, (ids, req, ref) in enumerate(zip(prompts, result.requests, reference, strict=True)):
        expected, verdict = _verdict(req, ref, fault if i == FAULT_REQUEST else "none")
        rows.append(
            {
                "prompt_tokens": len(ids),
                "pd": req.output_ids,
                "transformers": ref,
                "status": req.status,
                "reason": req.reason,
                "attempts": req.attempts,
                "notes": list(req.notes),
                "expected": expected,
                "right": verdict is None,
                "match": req.output_ids == ref,
                "cached_tokens": req.cached_tokens,
                "bytes": req.transfer_bytes,
                "timings": None if req.timing is None else {k: round(v, 6) for k, v in asdict(req.timing).items()},
            }
        )
        status = req.status + (f", attempt {req.attempts}" if req.attempts > 1 else "")
        shown = f"[green]{expected}[/]" if verdict is None else f"[red]{escape(verdict)}[/]"
        tokens.add_row(
            str(i), _describe(i, prompts), " ".join(map(str, req.output_ids)), " ".join(map(str, ref)), status, shown
        )
        t = req.timing
        spans = (
            ("-",) * 6
            if t is None
            else tuple(f"{v * 1e3:.1f}" for v in (t.queue_s, t.prefill_s, t.transfer_s, t.decode_s, t.ttft_s, t.tpot_s))
        )
        timings.add_row(str(i), str(req.cached_tokens), format_bytes(req.transfer_bytes), *spans)
    console.print(tokens)
    for i, r in enumerate(rows):
        what = "computed again after" if r["attempts"] > 1 else "waited for the restarted engine after"
        for note in r["notes"]:
            console.print(f"  request {i} {what}: {escape(note)}")
        if r["reason"]:
            console.print(f"  request {i} {r['status']}: {escape(r['reason'])}")
    console.print(timings)
    finished = [r for r in rows if r["status"] == FINISHED]
    console.print(
        f"{sum(r['match'] for r in finished)}/{len(finished)} finished requests token-exact against transformers, "
        f"{sum(r['right'] for r in rows)}/{len(rows)} verdicts right; {format_bytes(sum(r['bytes'] for r in rows))} "
        f"of KV and GDN state moved prefill -> decode; {len(result.pids)} processes started "
        f"({len(result.deaths)} killed), {wall:.1f} s including start-up"
    )
    return {
        "model": PD_MODEL,
        "prefill_pp": config.prefill_pp,
        "decode_tp": config.decode_tp,
        "transport": transport,
        "fault": {"kind": fault, "request": FAULT_REQUEST},
        "deaths": result.deaths,
        "requests": rows,
    }


def _verdict(req: RequestResult, reference: list[int], fault: str) -> tuple[str, str | None]:
    """What ``req`` should have ended as under ``fault`` (on it, or "none"), and why it did not (None: it did)."""
    from hybridkv.engine.disagg import FAILED, FINISHED

    if fault == "stall-transfer":
        return "Failed as intended", None if req.status == FAILED else f"{req.status}, but its transfer was stalled"
    expected = "match" if fault == "none" else "recovered, match"
    if req.status != FINISHED:
        return expected, f"{req.status}: {req.reason}"
    if req.output_ids != reference:
        return expected, "MISMATCH"
    if fault != "none" and req.attempts < 2:
        return expected, f"match, but the {fault} fault did not land (one attempt)"
    return expected, None


def _describe(i: int, prompts: list[list[int]]) -> str:
    """Prompt ``i``'s length and the longest prefix it shares with an earlier prompt."""
    ids = prompts[i]
    shared = max((_common_prefix(ids, p) for p in prompts[:i]), default=0)
    return f"{shared} shared + {len(ids) - shared}" if shared else str(len(ids))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def earlier_sections(console: Console, out: Path, gpu_memory: str) -> dict[str, Any]:
    """Planner on real models; a replay of a real trace through memory + cache (PNG); a real PD transfer
    checked byte for byte; a tiny model served through the engine, token for token against transformers."""
    from hybridkv.planner import plan_report
    from hybridkv.replay import run_demo_replay

    report: dict[str, Any] = {}
    console.rule("1. How many requests fit on one GPU: unified pool vs SGLang's default static split")
    rows = [
        {
            "model": model,
            "context": fit["context"],
            "unified": fit["unified"],
            "static": fit["static_sglang_default"],
            "ratio": fit["unified_over_static"],
        }
        for model in DEMO_MODELS
        for fit in plan_report(model, gpu_memory, contexts=[8192, 32768])["stages"][0]["requests"]
    ]
    table = Table()
    for col in ("model", "context", "unified", "static", "unified/static"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["model"], f"{r['context']:,}", f"{r['unified']:,}", f"{r['static']:,}", f"{r['ratio']:.2f}x")
    console.print(table)
    report["plan"] = rows

    console.rule("2. Serving the Mooncake conversation trace: memory + hybrid prefix cache (tables only)")
    replay = run_demo_replay(out)
    by_component = replay["hit_rate_by_component"]
    console.print(
        f"{replay['model']} on {replay['gpu_memory']}, {replay['requests']} requests: hit rate "
        f"{replay['hit_rate']:.4f} (full KV alone would claim {by_component['full_only']:.4f}); "
        f"peak {replay['peak_running']} running; {replay['memory_at_end']['bytes_moved'] / 2**30:.1f} GiB "
        f"moved by compaction; pool split over time: {replay['plot']}"
    )
    report["replay"] = {k: v for k, v in replay.items() if k != "timeline"}

    console.rule("3. Prefill -> decode transfer: 2 PP stage processes -> decode TP 2 over shm, every byte checked")
    from hybridkv.cli.pd_demo import print_pd_report, quiet_transfer_log
    from hybridkv.testing.pd_demo import run_pd_demo

    with quiet_transfer_log():
        pd = run_pd_demo("shm", models=("tiny-swa2-state",), requests=3, decode_tp=2)
    print_pd_report(console, pd)  # one line per request
    report["pd_transfer"] = pd

    console.rule("4. Real computation: a tiny random Qwen3-Next served by the engine, next to transformers' generate")
    report["engine"] = engine_section(console)  # one line per request

    return report


ENGINE_MODEL = "tiny-qwen3-next"


def engine_section(console: Console, max_new_tokens: int = 8) -> dict[str, Any]:
    """Requests sharing a 40-token prefix served by the engine (chunks of 12, pages of 16) and run one by
    one through ``transformers`` ``generate``: request 0 first, then 1-3 batched, starting from the prefix
    request 0 left in the prefix cache (full KV and a GDN state checkpoint at 32 tokens, a hit that ends
    inside a chunk); each request's cached tokens and tokens side by side with a match verdict."""
    import torch

    from hybridkv.engine.engine import Engine
    from hybridkv.engine.random_models import build_random, quiet_transformers

    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 256, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 9, 17, 26)]
    with quiet_transformers():
        hf, config = build_random(ENGINE_MODEL)
        engine = Engine(config, hf, gpu_memory="8MiB", page_size=16, chunk_size=12)
        outs = engine.generate(prompts[:1], max_new_tokens) + engine.generate(prompts[1:], max_new_tokens)
        with torch.no_grad():
            reference = [
                hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids) :].tolist()
                for ids in prompts
            ]
    table = Table()
    for col in ("request", "prompt", "cached (full/state)", "engine tokens", "transformers tokens", "verdict"):
        table.add_column(col)
    rows = []
    for i, (ids, out, ref) in enumerate(zip(prompts, outs, reference, strict=True)):
        match = out.output_ids == ref
        hit = out.hit
        full, state = (hit.full, hit.checkpoint) if hit is not None else (0, 0)
        rows.append(
            {
                "prompt_tokens": len(ids),
                "cached_tokens": out.cached_tokens,
                "hit_full": full,
                "hit_checkpoint": state,
                "engine": out.output_ids,
                "transformers": ref,
                "match": match,
            }
        )
        table.add_row(
            str(i),
            f"{len(prefix)} shared + {len(ids) - len(prefix)}",
            f"{out.cached_tokens} ({full}/{state})",
            " ".join(map(str, out.output_ids)),
            " ".join(map(str, ref)),
            "[green]match[/]" if match else "[red]MISMATCH[/]",
        )
    console.print(table)
    matched = sum(r["match"] for r in rows)
    cached = sum(o.cached_tokens for o in outs)
    console.print(
        f"{ENGINE_MODEL}: {matched}/{len(rows)} requests token-exact; {cached}/{sum(map(len, prompts))} prompt "
        f"tokens from the prefix cache; {engine.stats['steps']} engine steps (prefill chunks and decodes batched)"
    )
    return {"model": ENGINE_MODEL, "requests": rows, "steps": engine.stats["steps"], "cached_tokens": cached}
