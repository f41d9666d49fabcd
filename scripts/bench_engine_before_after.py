"""Before/after of the engine in one run: ``hybridkv bench engine``'s harness on an older revision and on this tree.

    .venv/bin/python scripts/bench_engine_before_after.py REV [--models a,b] [--rounds 3] [--json out.json]

``REV``'s ``src`` is extracted (``git archive``) to a temporary directory and this tree's
``hybridkv/bench/engine.py`` and ``hf_baselines.py`` are laid over it, so both sides run the same contenders and the
same measurement; then one process per (round, model, side) runs the bench with one round,
the sides alternating (the machine may be shared: the faster round of each is kept, CPU
time). transformers' contenders are the same code on both sides: their rounds are pooled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUN = "import json, sys; from hybridkv.bench.engine import run; print(json.dumps(run([sys.argv[1]], rounds=1)))"


def extract(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    tar = into / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    bench = (ROOT / "src/hybridkv/bench/engine.py").read_text()
    # the optional compiled path may not exist there; the before/after runs never compile
    bench = bench.replace(
        "from hybridkv.engine.compiled import compile_blocks as compiled_blocks\n", "compiled_blocks = None\n"
    )
    (into / "src/hybridkv/bench/engine.py").write_text(bench)
    for module in ("hf_baselines.py",):  # the harness's own modules, which an older revision may lack
        (into / "src/hybridkv/bench" / module).write_text((ROOT / "src/hybridkv/bench" / module).read_text())
    return into / "src"


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in samples:
        row = s["report"]["models"][0]
        model = out.setdefault(row["model"], {"tokens": row["tokens"], "not_run": row["not_run"], "runs": {}})
        for label, c in row["contenders"].items():
            key = f"engine ({s['side']})" if label == "engine" else label
            best = model["runs"].get(key)
            if best is None or c["cpu_s"] < best["cpu_s"]:
                model["runs"][key] = c
    for model in out.values():
        runs, tokens = model["runs"], model["tokens"]
        hf = {k: v for k, v in runs.items() if k.startswith("hf_")}
        strongest = max(hf, key=lambda k: tokens / hf[k]["cpu_s"])
        padded = min((k for k in hf if k.startswith("hf_padded")), key=lambda k: hf[k]["cpu_us_per_computed"])
        for side in ("before", "after"):
            e = runs[f"engine ({side})"]
            model[side] = {
                "vs_strongest": round(hf[strongest]["cpu_s"] / e["cpu_s"], 2),
                "strongest": strongest,
                "cpu_per_computed_ratio": round(e["cpu_us_per_computed"] / hf[padded]["cpu_us_per_computed"], 2),
                "padded": padded,
                "hybridkv_share": e["hybridkv_share"],
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev")
    parser.add_argument("--models", default="tiny-qwen3-next,tiny-gemma3,tiny-gpt-oss,tiny-nemotron-h,tiny-kimi-linear")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": extract(args.rev, Path(tmp)), "after": ROOT / "src"}
        samples = []
        for r in range(args.rounds):
            for model in args.models.split(","):
                for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                    env = dict(os.environ, PYTHONPATH=str(sides[side]), OMP_NUM_THREADS="1")
                    done = subprocess.run(
                        [sys.executable, "-c", RUN, model], env=env, capture_output=True, text=True, timeout=1800
                    )
                    if done.returncode:
                        sys.exit(f"error: {side} {model}: {done.stderr.strip().splitlines()[-1]}")
                    report = json.loads(done.stdout.strip().splitlines()[-1])
                    samples.append({"round": r, "side": side, "report": report})
                    print(f"round {r} {model} {side}: engine {report['models'][0]['contenders']['engine']['cpu_s']} s")
    result = summary(samples)
    goals = {m: {side: r[side] for side in ("before", "after")} for m, r in result.items()}
    print(json.dumps(goals, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": samples, "summary": result}))


if __name__ == "__main__":
    main()
