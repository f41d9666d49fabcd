"""The master launcher: every port on loopback, bounded start, clean stop, no process left."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from hybridkv.tiers import MooncakeMaster, TierError
from hybridkv.tiers.master import listening_sockets


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_every_master_port_is_on_loopback(mooncake_master):
    assert mooncake_master.proc is not None
    ports = listening_sockets(mooncake_master.proc.pid)
    assert (mooncake_master.address.split(":")[0], mooncake_master.rpc_port) in ports
    assert ("127.0.0.1", mooncake_master.metrics_port) in ports
    assert ports and all(addr == "127.0.0.1" for addr, _ in ports), ports


def test_stop_leaves_no_process_and_start_again_reuses_the_ports():
    master = MooncakeMaster().start()
    assert master.proc is not None
    pid, port = master.proc.pid, master.rpc_port
    master.kill()
    assert not _alive(pid)
    master.start()
    assert master.proc is not None and master.rpc_port == port
    assert ("127.0.0.1", port) in listening_sockets(master.proc.pid)
    pid = master.proc.pid
    master.stop()
    assert not _alive(pid) and not master.running


def test_a_port_taken_by_someone_else_fails_fast_with_the_log():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        master = MooncakeMaster(rpc_port=port, start_timeout_s=10)
        started = time.monotonic()
        with pytest.raises(TierError, match=f"127.0.0.1:{port} exited") as err:
            master.start()
        assert time.monotonic() - started < 10
        assert "log" in str(err.value) and master.proc is None


def test_the_master_dies_with_its_parent():
    """A parent killed with SIGKILL (no atexit) leaves no master behind."""
    code = (
        "from hybridkv.tiers import MooncakeMaster; m = MooncakeMaster().start(); "
        "print(m.proc.pid, flush=True); import time; time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert _alive(pid)
    finally:
        parent.kill()
        parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_the_module_runs_a_master_until_terminated():
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridkv.tiers"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        ready = line.startswith("mooncake_master at 127.0.0.1:")
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()  # nothing outlives the test (its master dies with it: PR_SET_PDEATHSIG)
            proc.communicate(timeout=10)
            raise
    assert ready, (line, err)
    assert proc.returncode == 0, err
