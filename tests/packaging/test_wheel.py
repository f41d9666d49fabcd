"""The built wheel stands alone: presets and traces are package data, not files of a checkout.

Builds the wheel, installs it (without dependencies) into a fresh venv that sees this venv's
third-party packages through a plain path entry (so the checkout's editable install is NOT
visible), and runs the CLI from a directory outside the checkout.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp), str(ROOT)],
        cwd=tmp,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp.glob("hybridkv-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    (purelib,) = (env_dir / "lib").glob("python3*/site-packages")
    # A plain path entry: third-party packages import, but the .pth files inside (the
    # checkout's editable install) are not processed.
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "deps.pth").write_text("\n".join(deps) + "\n")
    installed = _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(purelib), str(wheel)],
        cwd=tmp,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    return env_dir


def test_installed_wheel_serves_presets_and_traces(wheel_venv: Path, tmp_path: Path) -> None:
    py = str(wheel_venv / "bin" / "python")
    where = _run([py, "-c", "import hybridkv; print(hybridkv.__file__)"], cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert str(ROOT) not in where.stdout and str(wheel_venv) in where.stdout, where.stdout

    presets = _run([py, "-m", "hybridkv", "presets"], cwd=tmp_path)
    assert presets.returncode == 0, presets.stderr[-2000:]
    assert "Qwen3-Next-80B-A3B-Instruct" in presets.stdout

    args = ["replay", "--trace", "mooncake-conversation", "--model", "Qwen3-Next-80B-A3B-Instruct"]
    replay = _run([py, "-m", "hybridkv", *args, "--gpu-memory", "20GiB", "--limit", "40", "--json"], cwd=tmp_path)
    assert replay.returncode == 0, replay.stderr[-2000:]
    (run,) = json.loads(replay.stdout)["runs"]
    assert run["workload"] == "mooncake:mooncake_conversation_trace.jsonl.gz"
    assert run["requests"] == 40 and run["input_tokens"] > 0 and 0 < run["hit_rate"] < 1
