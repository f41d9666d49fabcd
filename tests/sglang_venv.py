"""The SGLang python the SGLang tests drive their children with: ``HYBRIDKV_SGLANG_PYTHON`` when set, else
``.venv-sglang/bin/python`` after ``scripts/setup_sglang.sh`` (a no-op once its install is done; run alone, it
installs, or waits for an install under way). Where neither is to be had, the caller's tests skip naming why."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup_sglang.sh"
SETUP_TIMEOUT_S = 900  # a fresh install takes about two minutes; `make test`'s own may hold the lock meanwhile


def sglang_python() -> Path:
    """The SGLang python, or ``pytest.skip`` with one line saying why there is none."""
    given = os.environ.get("HYBRIDKV_SGLANG_PYTHON")
    if given:
        if not Path(given).is_file():
            pytest.skip(f"SGLang not installed: HYBRIDKV_SGLANG_PYTHON={given} is no file")
        return Path(given)
    try:
        done = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"SGLang not installed: {SETUP.name} ran past {SETUP_TIMEOUT_S} s")
    if done.returncode != 0:
        why = ((done.stdout + done.stderr).strip().splitlines() or [f"exit {done.returncode}"])[-1]
        pytest.skip(f"SGLang not installed: {why}")
    return ROOT / ".venv-sglang" / "bin" / "python"
