"""Runs SGLang's own benchmark client (``python -m sglang.bench_serving``, sglang 0.5.23, unchanged) several times in
one process, under ``.venv-sglang``'s python: each run exactly as ``python -m`` runs it (``runpy`` with its argv), so
SGLang's import cost is paid once. Not a test module: ``test_sglang_client.py`` starts it.

Input (argv[1]): a JSON object ``{name: [client arguments]}``. Output: one JSON line on stdout, ``{name: result}``,
where a result holds the run's JSON record (what ``--output-file`` wrote), the figures ``--cache-report`` printed
(``cached_tokens``, ``hit_rate_percent``; absent when not asked), and ``error`` (the exception that ended the run,
or None). The client's own printout goes to stderr.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any


def run_client(argv: list[str], record: Path) -> dict[str, Any]:
    printed = io.StringIO()
    error = None
    sys.argv = ["sglang.bench_serving", *argv, "--output-file", str(record)]
    with contextlib.redirect_stdout(printed):
        try:
            runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
        except BaseException as exc:  # a SystemExit or the client's own error is the result
            error = "".join(traceback.format_exception_only(exc)).strip()
    text = printed.getvalue()
    sys.stderr.write(text)
    result: dict[str, Any] = {"error": error, "record": None}
    if record.is_file() and record.read_text().strip():
        result["record"] = json.loads(record.read_text().strip().splitlines()[-1])
    cached = re.search(r"Total cached tokens:\s+(\d+)", text)
    rate = re.search(r"Cache hit rate:\s+([\d.]+)%", text)
    if cached and rate:
        result["cached_tokens"], result["hit_rate_percent"] = int(cached.group(1)), float(rate.group(1))
    return result


def main() -> None:
    runs: dict[str, list[str]] = json.loads(sys.argv[1])
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, argv in runs.items():
            results[name] = run_client(argv, Path(scratch) / f"{name.replace('/', '_')}.jsonl")
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
