"""The README's short tour runs as written from the repository root (``examples/`` ships its inputs).

Every command of the tour is parsed by the CLI's own parser (its subcommand and every option exist, every
value converts), so none can rot; the quick ones run in ``make test`` (in-process, outputs checked), the slow
ones (a trace replay, the benchmarks, the PD demos) under ``pytest -m slow``. A command that serves until
SIGTERM is started, asked one request and stopped (``--port 0`` instead of a fixed port, the one change).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer

from hybridkv.cli import main
from hybridkv.cli.app import app
from tests.server.conftest import listening_url

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HYBRIDKV = ".venv/bin/hybridkv"

SLOW = ("replay", "pd-demo", "bench", "serve-pd")
"""Subcommands that take tens of seconds to minutes (``pytest -m slow`` runs them)."""


def tour() -> list[list[str]]:
    """The tour's commands: one argument list each (continuation lines joined, comments dropped)."""
    block = re.search(r"## A short tour\n\n```sh\n(.*?)```", README.read_text(), re.S)
    assert block is not None, "README lost its short tour"
    text = block.group(1).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()]


def hybridkv_args(command: list[str]) -> list[str]:
    assert command[0] == HYBRIDKV, f"a tour command that is not {HYBRIDKV}: {command}"
    return command[1:]


def is_slow(args: list[str]) -> bool:
    return args[0] in SLOW or (args[0] == "generate" and "--store" in args)


def is_server(args: list[str]) -> bool:
    return args[0] == "serve"


COMMANDS = tour()
CLI = [c for c in COMMANDS if c[0] == HYBRIDKV]


@pytest.fixture(scope="module", autouse=True)
def at_root() -> object:
    """Run from the repository root, as the README says; the tiny model directory the tour writes first."""
    old = Path.cwd()
    os.chdir(ROOT)
    if not (ROOT / "out/tiny-model/config.json").exists():
        (script,) = [c for c in COMMANDS if c[1:2] == ["examples/make_tiny_model.py"]]
        subprocess.run([sys.executable, *script[1:]], check=True, timeout=120)
    yield
    os.chdir(old)


def test_the_tour_has_its_commands_and_ships_their_inputs() -> None:
    assert len(CLI) >= 20
    for command in COMMANDS:
        for arg in command:
            if arg.startswith("examples/"):
                assert (ROOT / arg).exists(), f"the tour names {arg}, which does not ship"
    assert not [a for c in COMMANDS for a in c if "path/to" in a]


@pytest.mark.parametrize("command", CLI, ids=[" ".join(c[1:4]) for c in CLI])
def test_every_tour_command_parses(command: list[str]) -> None:
    """The subcommand exists, every option exists and every value converts (the CLI's own parser and callbacks;
    nothing runs)."""
    cmd: Any = typer.main.get_command(app)  # typer's own (vendored) click command classes
    rest = hybridkv_args(command)
    while hasattr(cmd, "get_command"):  # a group: its subcommand
        sub = cmd.get_command(cmd.context_class(cmd), rest[0])
        assert sub is not None, f"no subcommand {rest[0]!r} ({command})"
        cmd, rest = sub, rest[1:]
    with cmd.make_context(cmd.name or "", list(rest)) as ctx:  # raises on an unknown option or a bad value
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        assert {a for a in rest if a.startswith("--")} <= known
        assert ctx.params or not cmd.params  # (presets takes none)


QUICK = [c for c in CLI if not is_slow(hybridkv_args(c)) and not is_server(hybridkv_args(c))]


@pytest.mark.parametrize("command", QUICK, ids=[" ".join(c[1:4]) for c in QUICK])
def test_quick_tour_commands_run(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    args = hybridkv_args(command)
    assert main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.strip()
    if "--json" in args:
        report = json.loads(out)
        assert report["totals"]["errors"] == 0 and len(report["requests"]) == 6


SLOW_COMMANDS = [c for c in CLI if is_slow(hybridkv_args(c))]


@pytest.mark.slow
@pytest.mark.parametrize("command", SLOW_COMMANDS, ids=[" ".join(c[1:4]) for c in SLOW_COMMANDS])
def test_slow_tour_commands_run(command: list[str]) -> None:
    args = hybridkv_args(command)
    done = subprocess.run([sys.executable, "-m", "hybridkv", *args], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]


SERVERS = [c for c in CLI if is_server(hybridkv_args(c))]


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=[pytest.mark.slow] if "--disaggregated" in c else []) for c in SERVERS],
    ids=[" ".join(c[1:5]) for c in SERVERS],
)
def test_tour_servers_answer_and_stop_on_sigterm(command: list[str], tmp_path: Path) -> None:
    args = hybridkv_args(command)
    if "--port" in args:
        args[args.index("--port") + 1] = "0"
    else:
        args += ["--port", "0"]
    out, err = (tmp_path / "out").open("w+"), (tmp_path / "err").open("w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", *args], stdout=out, stderr=err, env=env)
    try:
        url = listening_url(proc, tmp_path, 120)
        headers = {"Authorization": f"Bearer {args[args.index('--api-key') + 1]}"} if "--api-key" in args else {}
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2}}
        r = httpx.post(f"{url}/generate", json=body, headers=headers, timeout=120)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
