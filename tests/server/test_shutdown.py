"""``hybridkv serve`` as a real process, single-process and ``--disaggregated``: SIGTERM with requests in
flight is a clean, bounded exit.

Short requests in flight finish (graceful), a long one is cut at ``--shutdown-timeout``, new
connections are refused, the process exits 0 with no traceback and leaves no child behind; the
disaggregated server reaps every worker process and unlinks every shared-memory file it made.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from hybridkv.engine.random_models import save_random
from tests.server.conftest import MODEL, listening_url

SHUTDOWN_TIMEOUT = 2


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        found += [int(c) for c in task.read_text().split()]
    return found


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``: its command line, after its parent's id (``PPID: ``)."""
    found = {}
    for child in children(pid):
        found[child] = f"{pid}: " + Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        found |= descendants(child)
    return found


def workers(procs: dict[int, str]) -> list[int]:
    """The engine workers among ``procs`` (``descendants``): forked by the engine forkserver, a forkserver's
    children."""
    forkservers = {pid for pid, cmd in procs.items() if "forkserver" in cmd}
    return [pid for pid, cmd in procs.items() if int(cmd.split(":", 1)[0]) in forkservers]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def shm_files(pids: dict[int, str]) -> set[str]:
    """The /dev/shm/hybridkv-* files mapped by ``pids``."""
    found: set[str] = set()
    for pid in pids:
        found |= set(re.findall(r"/dev/shm/hybridkv-[0-9a-f]+", Path(f"/proc/{pid}/maps").read_text()))
    return found


def serve_and_sigterm(
    tmp_path: Path, args: list[str], long_new: int = 480
) -> tuple[int, float, dict[int, Any], str, dict[int, str], set[str]]:
    """``hybridkv serve ARGS``; 4 streams (3 short, 1 long: ``long_new`` tokens) in flight, then SIGTERM. Its exit
    code, how long it took to exit, each stream's last chunk, the server's stderr, its descendant processes and
    their shm files (both as they were before the signal)."""
    out, err = (tmp_path / "out").open("w+"), (tmp_path / "err").open("w+")
    cmd = [sys.executable, "-m", "hybridkv", "serve", "--port", "0", *args]
    cmd += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = listening_url(proc, tmp_path, 240)
        ends: dict[int, Any] = {}
        started = threading.Barrier(5, timeout=120)

        def stream(i: int, max_new: int) -> None:
            body = {"input_ids": [5 + i] * 12, "sampling_params": {"max_new_tokens": max_new}, "stream": True}
            last = None
            try:
                with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as resp:
                    for n, line in enumerate(line for line in resp.iter_lines() if line.startswith("data: {")):
                        last = json.loads(line.removeprefix("data: "))
                        if n == 0:
                            started.wait()
            except httpx.HTTPError as exc:  # the long one: its connection is cut at the timeout
                last = {"cut": type(exc).__name__}
            ends[i] = last

        threads = [threading.Thread(target=stream, args=(i, 20 if i else long_new), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        started.wait()  # every request is streaming
        procs = descendants(proc.pid)
        shm = shm_files(procs)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=SHUTDOWN_TIMEOUT + 60)
        took = time.monotonic() - sent
        for t in threads:
            t.join(30)
        try:
            httpx.get(f"{url}/health", timeout=5)
            raise AssertionError("the server still accepts connections")
        except httpx.ConnectError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return code, took, ends, (tmp_path / "err").read_text(), procs, shm


def check_clean_exit(code: int, took: float, ends: dict[int, Any], stderr: str, limit_s: float) -> None:
    assert code == 0, stderr
    assert "Traceback" not in stderr and "shut down (SIGTERM)" in stderr
    assert took < limit_s
    for i in (1, 2, 3):  # short ones finished during the graceful period
        assert ends[i]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}, ends[i]
    long = ends[0]  # the long one did not finish: cut or aborted, never completed
    assert "cut" in long or long["meta_info"]["finish_reason"]["type"] == "abort", long


def test_sigterm_with_requests_in_flight_exits_cleanly(tmp_path: Path) -> None:
    # a model allowing 8k tokens, so the long request outlasts --shutdown-timeout however fast the engine decodes
    model = tmp_path / "model"
    save_random(MODEL, str(model))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    args = ["--model", str(model), "--gpu-memory", "64MiB"]
    code, took, ends, stderr, procs, _ = serve_and_sigterm(tmp_path, args, long_new=4000)
    assert procs == {}
    check_clean_exit(code, took, ends, stderr, SHUTDOWN_TIMEOUT + 15)
    # the one sizing story (cli/sizing.py): the work is unknown, so the default context (below the model's 8192)
    assert "hybridkv serve: max context 4,096 tokens (the default, 4,096, page 16, chunk 2048)" in stderr, stderr
    assert "--gpu-memory 64.00 MiB (one 4,096-token request needs" in stderr, stderr


def test_sigterm_on_the_disaggregated_server_reaps_every_worker_and_unlinks_every_shm_file(tmp_path: Path) -> None:
    args = ["--disaggregated", "--random", MODEL, "--prefill-pp", "2", "--decode-tp", "2", "--transport", "shm"]
    code, took, ends, stderr, procs, shm = serve_and_sigterm(tmp_path, [*args, "--gpu-memory", "16MiB"])
    forked = workers(procs)
    assert len(forked) == 4 and len(shm) == 2, procs  # 2 prefill stages, 2 decode ranks; 2 decode arenas
    check_clean_exit(code, took, ends, stderr, SHUTDOWN_TIMEOUT + 40)
    assert "hybridkv serve --disaggregated: max context 512 tokens" in stderr, stderr
    assert "--gpu-memory 16.00 MiB per process" in stderr, stderr
    # reaped before the server exited: gone now (a worker left to notice its parent's death takes up to 1 s)
    assert [pid for pid in forked if alive(pid)] == []
    assert [path for path in shm if Path(path).exists()] == []
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits once its pipe closes
    while any(alive(pid) for pid in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [cmd for pid, cmd in procs.items() if alive(pid)] == []
