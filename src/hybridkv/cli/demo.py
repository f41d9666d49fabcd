"""``hybridkv demo`` (``make demo``): a tiny random Qwen3-Next served over HTTP by ``hybridkv serve --disaggregated``,
token-exact against transformers.

The default run: ``hybridkv serve --disaggregated`` (a real server process, ``cli.demo_serve``) whose
2 pipeline-stage prefill processes hand KV and GDN state over the Mooncake transfer engine (TCP) to 2
tensor-parallel decode processes; an httpx client streams six shared-prefix requests (the first two
alone, then the rest concurrently), with one deliberate fault on request ``FAULT_REQUEST`` (the
server's ``--fault``; ``--fault`` here): ``kill-prefill`` (default) SIGKILLs prefill stage 1 while it
sends that request, ``kill-decode`` SIGKILLs decode TP rank 1 while it holds it (either engine
restarts and the request is computed again), ``stall-transfer`` holds its KV back past the decode
side's transfer timeout (it ends failed). Per request: its tokens as the client got them next to
``transformers``' greedy tokens, its status and a verdict, then its prefix-cache hit, TTFT and
end-to-end latency as the client saw them; then the server's ``/metrics`` figures.

A verdict is right when a request finished with ``transformers``' tokens, except the stalled
request, which must end failed, and a killed-engine request, whose fault must also show in
``/metrics`` (one worker death, one restart of its engine). The command exits 1 unless every
verdict is right and every worker holds again what it held before the first request. ``--all``
first runs the earlier sections (the planner on real models, a replay of the Mooncake trace, a
byte-checked multi-process transfer, the single-process engine); their checks count too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hybridkv.cli.app import app
from hybridkv.cli.params import TRANSPORT_CHOICES, transport_option
from hybridkv.units import format_bytes

if TYPE_CHECKING:
    from hybridkv.cli.demo_serve import Served

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
    transport: str = typer.Option("mooncake", "--transport", callback=transport_option, help=f"{TRANSPORT_CHOICES}."),
    fault: str = typer.Option(
        "kill-prefill", "--fault", callback=_fault_option, help=f"On request {FAULT_REQUEST}: {', '.join(DEMO_FAULTS)}."
    ),
    all_sections: bool = typer.Option(
        False, "--all", help="Before it: the planner, a trace replay, a byte-checked transfer, the engine."
    ),
    gpu_memory: str = typer.Option("80GiB", "--gpu-memory", help="The planner's GPU (--all)."),
) -> None:
    """A tiny random Qwen3-Next behind hybridkv serve --disaggregated (2 PP prefill processes -> decode TP 2
    processes over Mooncake), driven over HTTP, one deliberate fault, every request's tokens next to
    transformers' with a verdict, and the server's /metrics. Exits 1 unless every verdict is right.
    With --all it first runs the earlier sections."""
    console = Console(width=max(Console().width, 150))
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    if all_sections:
        report.update(earlier_sections(console, out, gpu_memory))
        console.rule(
            "5. hybridkv serve --disaggregated: 2 PP prefill processes -> decode TP 2, over HTTP, vs transformers"
        )
    pd = report["pd"] = pd_section(console, requests, transport, fault)
    (out / "demo.json").write_text(json.dumps(report, indent=1))
    console.print(f"report: {out / 'demo.json'}")
    verdicts = [r["right"] for r in pd["requests"]] + [pd["released"]]
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
    """Serve ``pd_prompts(requests)`` through ``hybridkv serve --disaggregated`` (PP 2 -> TP 2, pages of 16,
    prefill chunks of 16, the prefill prefix cache on, ``fault`` on request ``FAULT_REQUEST``) streamed by an
    HTTP client, and with ``transformers``; print a row per request: tokens side by side, status, verdict;
    then its cache hit and latencies as the client saw them, and the server's ``/metrics`` figures."""
    import tempfile

    from hybridkv.cli.demo_serve import serve_requests, server_args
    from hybridkv.engine.random_models import quiet_transformers, save_random

    prompts = pd_prompts(requests)
    faults: list[str] = []
    timeout = None
    if fault == "stall-transfer":
        faults, timeout = [f"{fault}:{FAULT_REQUEST}:0:{STALL_TIMEOUT_S + 2}"], STALL_TIMEOUT_S
    elif fault != "none":  # kill-prefill: stage 1's writes slowed (5 s each), killed mid-way; kill-decode: rank 1
        faults = [f"{fault}:{FAULT_REQUEST}:1:5"]
    with tempfile.TemporaryDirectory(prefix="hybridkv-demo-") as model_dir:
        hf = save_random(PD_MODEL, model_dir)
        # as many tokens as the reference; the requests before the faulted one alone, one at a time (the later
        # ones hit their prefix in the prefill cache), then the rest at once
        run = serve_requests(model_dir, prompts, PD_MAX_NEW, FAULT_REQUEST, transport, faults, timeout)
    with quiet_transformers():
        reference = reference_tokens(hf, prompts, PD_MAX_NEW)
    m = run.metrics
    landed = _fault_landed(fault, m)
    tokens = Table(
        title=f"{PD_MODEL} behind hybridkv serve --disaggregated: prefill PP 2 (one process per stage) -> decode "
        f"TP 2 (one process per rank) over {transport}, {len(prompts)} requests streamed over HTTP, {PD_MAX_NEW} "
        f"greedy tokens each, vs transformers generate; fault on request {FAULT_REQUEST}: {fault}"
    )
    for col in ("request", "prompt tokens", "served (HTTP)", "transformers", "status", "verdict"):
        tokens.add_column(col, no_wrap=True)
    latency = Table(title="per request, as the client saw it: prefill prefix-cache hit, ms")
    for col in ("request", "cached", "TTFT", "end to end"):
        latency.add_column(col, justify="left" if col == "request" else "right")
    rows: list[dict[str, Any]] = []
    for i, (ids, req, ref) in enumerate(zip(prompts, run.requests, reference, strict=True)):
        expected, verdict = _verdict(req, ref, fault if i == FAULT_REQUEST else "none", landed)
        status = _status(req)
        rows.append(
            {
                "prompt_tokens": len(ids),
                "pd": req.tokens,
                "transformers": ref,
                "status": status,
                "reason": req.message,
                "expected": expected,
                "right": verdict is None,
                "match": req.tokens == ref,
                "cached_tokens": req.cached_tokens,
                "ttft_s": req.ttft_s,
                "e2e_s": round(req.e2e_s, 6),
            }
        )
        shown = f"[green]{expected}[/]" if verdict is None else f"[red]{escape(verdict)}[/]"
        tokens.add_row(
            str(i), _describe(i, prompts), " ".join(map(str, req.tokens)), " ".join(map(str, ref)), status, shown
        )
        ttft = "-" if req.ttft_s is None else f"{req.ttft_s * 1e3:.1f}"
        latency.add_row(str(i), str(req.cached_tokens), ttft, f"{req.e2e_s * 1e3:.1f}")
    console.print(tokens)
    for i, r in enumerate(rows):
        if r["reason"]:
            console.print(f"  request {i} {r['status']}: {escape(r['reason'])}")
    if fault in ("kill-prefill", "kill-decode"):
        engine = fault.removeprefix("kill-")
        console.print(
            f"  fault {fault} on request {FAULT_REQUEST}: "
            + (f"one worker died, the {engine} engine restarted (/metrics)" if landed is None else f"[red]{landed}[/]")
        )
    console.print(latency)
    figures = server_figures(m)
    released = figures["pages held by requests"] == 0 and figures["slots held by requests"] == 0
    console.print(_figures_table(figures, m))
    finished = [r for r in rows if r["status"] == "finished"]
    console.print(
        f"{sum(r['match'] for r in finished)}/{len(finished)} finished requests token-exact against transformers, "
        f"{sum(r['right'] for r in rows)}/{len(rows)} verdicts right; "
        f"{format_bytes(int(figures['KV + state bytes moved prefill -> decode']))} of KV and GDN state moved "
        f"prefill -> decode; {run.wall_s:.1f} s including the server's start-up and shutdown"
    )
    held = "every page and slot back on every worker" if released else "[red]NOT every page and slot back[/]"
    console.print(f"memory after the run: {held} (/metrics: pages and slots held by requests)")
    return {
        "model": PD_MODEL,
        "prefill_pp": 2,
        "decode_tp": 2,
        "transport": transport,
        "fault": {"kind": fault, "request": FAULT_REQUEST, "landed": landed is None},
        "server": "hybridkv serve " + " ".join(server_args("MODEL_DIR", transport, faults, timeout)),
        "metrics": figures,
        "released": released,
        "requests": rows,
    }


def _status(req: Served) -> str:
    return {"length": "finished", "stop": "finished", "abort": "aborted", "error": "failed"}.get(req.finish, "no end")


def _fault_landed(fault: str, m: dict[str, float]) -> str | None:
    """None when a kill fault killed exactly one worker of its engine and that engine restarted once (or there was
    no kill fault); else what the server's /metrics show instead."""
    if fault not in ("kill-prefill", "kill-decode"):
        return None
    engine = fault.removeprefix("kill-")
    deaths = m.get("hybridkv_pd_worker_deaths_total", 0)
    restarts = m.get(f'hybridkv_pd_engine_restarts_total{{engine="{engine}"}}', 0)
    if deaths == 1 and restarts == 1:
        return None
    return f"the fault did not land as intended ({deaths:.0f} worker deaths, {restarts:.0f} {engine} restarts)"


def _verdict(req: Served, reference: list[int], fault: str, landed: str | None) -> tuple[str, str | None]:
    """What ``req`` should have ended as under ``fault`` (on it, or "none"), and why it
    did not (None: it did); ``landed``: why a kill fault did not land (None: it did)."""
    status = _status(req)
    if fault == "stall-transfer":
        return "Failed as intended", None if status == "failed" else f"{status}, but its transfer was stalled"
    expected = "match" if fault == "none" else "recovered, match"
    if status != "finished":
        return expected, f"{status}: {req.message}"
    if req.tokens != reference:
        return expected, "MISMATCH"
    if fault != "none" and landed is not None:
        return expected, "match, but the fault did not land"
    return expected, None


FIGURES = {  # what the demo shows of /metrics: label -> series
    "requests served": "hybridkv_engine_requests_total",
    "prompt tokens": "hybridkv_prompt_tokens_total",
    "prompt tokens from the prefill prefix cache": "hybridkv_prefix_cache_hit_tokens_total",
    "KV + state bytes moved prefill -> decode": "hybridkv_transfer_bytes_total",
    "failed transfers": "hybridkv_transfer_failures_total",
    "failed requests": "hybridkv_engine_failed_requests_total",
    "worker deaths": "hybridkv_pd_worker_deaths_total",
    "prefill engine restarts": 'hybridkv_pd_engine_restarts_total{engine="prefill"}',
    "decode engine restarts": 'hybridkv_pd_engine_restarts_total{engine="decode"}',
    "pages held by requests": "hybridkv_request_pages",
    "slots held by requests": "hybridkv_request_slots",
}


def server_figures(m: dict[str, float]) -> dict[str, float]:
    """The ``FIGURES`` of a /metrics scrape (-1 for a series it lacks) and the mean TTFT the server observed."""
    out = {label: m.get(series, -1.0) for label, series in FIGURES.items()}
    count = m.get("hybridkv_time_to_first_token_seconds_count", 0)
    out["mean TTFT (s)"] = round(m.get("hybridkv_time_to_first_token_seconds_sum", 0) / count, 4) if count else -1
    return out


def _figures_table(figures: dict[str, float], m: dict[str, float]) -> Table:
    table = Table(title="the server's /metrics after the run (hybridkv_*; pages / slots per worker: now vs before)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for label, value in figures.items():
        table.add_row(label, format_bytes(int(value)) if "bytes" in label else f"{value:g}")
    for key, value in sorted(m.items()):
        if key.startswith("hybridkv_pd_worker_pages{") and 'state="live"' in key:
            worker = key.split('worker="', 1)[1].rstrip('"}')
            before = m.get(key.replace('state="live"', 'state="before"'), -1)
            slots = m.get(key.replace("_pages{", "_slots{"), -1)
            slots_before = m.get(key.replace("_pages{", "_slots{").replace('state="live"', 'state="before"'), -1)
            table.add_row(worker, f"{value:g}/{before:g} pages, {slots:g}/{slots_before:g} slots")
    return table


def _describe(i: int, prompts: list[list[int]]) -> str:
    """Prompt ``i``'s length and the longest prefix it shares with an earlier prompt."""
    from hybridkv.engine.sched.scheduler import shared_prefix

    ids = prompts[i]
    shared = max((shared_prefix(ids, p, len(ids)) for p in prompts[:i]), default=0)
    return f"{shared} shared + {len(ids) - shared}" if shared else str(len(ids))


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

    from hybridkv.engine.config import EngineConfig
    from hybridkv.engine.engine import Engine
    from hybridkv.engine.random_models import build_random, quiet_transformers

    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 256, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 9, 17, 26)]
    with quiet_transformers():
        hf, config = build_random(ENGINE_MODEL)
        engine = Engine(config, hf, EngineConfig(gpu_memory="8MiB", page_size=16, chunk_size=12))
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
