"""``hybridkv demo``: the main job, end to end on real presets and real traces, and a model served through it."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from hybridkv.cli.app import app

DEMO_MODELS = ["Qwen3-Next-80B-A3B-Instruct", "Gemma-3-27B-IT", "gpt-oss-120b", "Kimi-Linear-48B-A3B-Instruct"]


@app.command()
def demo(
    out: Path = typer.Option(Path("out/demo"), "--out", help="Where PNGs and the JSON report go."),
    gpu_memory: str = typer.Option("80GiB", "--gpu-memory"),
) -> None:
    """Planner on real models; a replay of a real trace through memory + cache (PNG); a real PD transfer;
    a tiny model served through the engine, token for token against transformers."""
    from hybridkv.planner import plan_report
    from hybridkv.replay import run_demo_replay

    console = Console()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {}

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
    print_pd_report(Console(width=max(console.width, 150)), pd)  # one line per request
    report["pd_transfer"] = pd

    console.rule("4. Real computation: a tiny random Qwen3-Next served by the engine, next to transformers' generate")
    report["engine"] = engine_section(Console(width=max(console.width, 120)))  # one line per request

    (out / "demo.json").write_text(json.dumps(report, indent=1))
    console.print(f"report: {out / 'demo.json'}")


ENGINE_MODEL = "tiny-qwen3-next"


def engine_section(console: Console, max_new_tokens: int = 8) -> dict[str, object]:
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
