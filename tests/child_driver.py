"""Running a test driver in another venv's python: ``run_driver(cmd, out, env, timeout_s, what)`` starts it in a
session of its own, its output to ``out``'s ``.log``, waits at most ``timeout_s``, kills its whole process group
whatever happened (nothing left behind), fails the test with the log's tail unless it exited 0, and returns the JSON
it wrote to ``out``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest


def run_driver(cmd: list[str], out: Path, env: dict[str, str], timeout_s: float, what: str) -> dict[str, Any]:
    """Run ``cmd`` (which writes its report to ``out``); its report. ``what`` names it in a failure."""
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        pytest.fail(f"{what} {'timed out' if rc is None else f'exited {rc}'}:\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())
