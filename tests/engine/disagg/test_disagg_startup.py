"""Starting a disaggregated server (issue 19 item 8): what is refused before any process starts, how a
start-up that fails is reported, that it leaves no session file, and what reaches stderr.

- A checkpoint that cannot load (a truncated ``*.safetensors`` file, a missing weight) is refused by the
  router from the files' headers (``check_layout``), before any worker starts: a ``WeightError`` naming
  the file or weight; ``serve-pd --model DIR`` prints it as one ``error:`` line, exit 2.
- A decode worker SIGKILLed while starting, right after it created its shared-memory arena: the server
  does not start, ``PDStartError`` says "died while starting (killed by SIGKILL)", no process is left
  and neither decode rank's ``/dev/shm/hybridkv-*`` file is left (the router named them before start).
- A worker whose sentinel fires a moment before its exit code can be read is reported by how it ended,
  never "still running" (``exit_reason`` joins it first).
- ``WorkerLog``: a worker's fd 2 is read by the launcher; Mooncake's glog lines become counted log
  records on ``hybridkv.transfer.mooncake`` and never reach the launcher's stderr raw; every other
  line does, unchanged (a last line without a newline too).
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.engine.disagg import PD_ENGINE, PDConfig, PDServer, PDStartError
from hybridkv.engine.disagg.engines import EngineState, await_ready
from hybridkv.engine.disagg.procs import EngineProcs
from hybridkv.engine.disagg.worker_log import WorkerLog
from hybridkv.engine.errors import WeightError
from hybridkv.engine.parallel.forkserver import forkserver_pid
from hybridkv.engine.sched.scheduler import Role
from tests.engine.disagg.test_disagg import CHUNK, PAGE, gone
from tests.engine.disagg.test_disagg_faults import children
from tests.engine.harness import hf_model

NAME = "tiny-qwen3-next"
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / NAME
    hf_model(NAME).save_pretrained(path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _drop_weight(file: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})


def test_a_checkpoint_that_cannot_load_is_refused_by_the_router_before_any_worker_starts(
    saved: Path, tmp_path: Path, capsys
) -> None:
    before = children()
    truncated = _copy(saved, tmp_path / "truncated")
    (truncated / "model.safetensors").write_bytes((saved / "model.safetensors").read_bytes()[:100_000])
    missing = _copy(saved, tmp_path / "missing")
    _drop_weight(missing / "model.safetensors", "model.layers.3.self_attn.o_proj.weight")  # stage 1
    for model, says in [
        (truncated, "model.safetensors"),
        (missing, r"missing weights for .*layers\.3\.self_attn\.o_proj"),
    ]:
        with pytest.raises(WeightError, match=says) as err:  # the router's own check, not a worker's traceback
            PDServer(
                PDConfig(str(model), engine=replace(PD_ENGINE, page_size=PAGE, chunk_size=CHUNK, gpu_memory=3_000_000))
            )
        assert not isinstance(err.value, PDStartError) and "Traceback" not in str(err.value)
    assert children() <= before  # not even a forkserver started

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n')
    assert main(["serve-pd", "--model", str(missing), "--prompts", str(prompts)]) == 2
    err_text = capsys.readouterr().err
    assert err_text.count("\n") == 1 and err_text.startswith("error: ") and "o_proj" in err_text, err_text
    assert "failed to start" not in err_text
    assert children() <= before


def _descendant(pid: int) -> bool:
    """Whether ``pid`` is this process's child or grandchild (a worker forked by our forkserver)."""
    me = os.getpid()
    for _ in range(2):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            return False
        if pid == me:
            return True
    return False


def _owner(path: Path) -> int:
    """The owner pid in a hybridkv shared arena's header (0 until written)."""
    try:
        with path.open("rb") as f:
            head = f.read(48)
    except OSError:
        return 0
    return struct.unpack("<16sQ16sQ", head)[3] if len(head) == 48 else 0


def test_a_decode_worker_killed_while_starting_is_reported_by_its_signal_and_leaves_no_session_file(
    saved: Path,
) -> None:
    # a watcher SIGKILLs the first of our decode workers whose shm arena appears (right after it created
    # it, long before it can say Ready); every arena our workers created must be gone afterwards
    before = set(SHM.glob("hybridkv-*"))
    ours: set[Path] = set()
    killed: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for path in set(SHM.glob("hybridkv-*")) - before:
                pid = _owner(path)
                if pid and _descendant(pid):
                    ours.add(path)
                    if not killed:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    config = PDConfig(str(saved), engine=replace(PD_ENGINE, page_size=PAGE, chunk_size=CHUNK, gpu_memory=3_000_000))
    try:
        with pytest.raises(PDStartError, match=r"decode TP rank \d died while starting \(killed by SIGKILL\)"):
            PDServer(config).close()  # close() only if it started anyway: then the raises fails the test
    finally:
        stop.set()
        watcher.join(5)
    assert killed and ours, "the watcher saw no decode arena of ours"
    assert not [p for p in ours if p.exists()], "a failed start-up left a session file behind"
    assert all(gone(pid) for pid in killed)


def close_pipes_then_die(rank: int, conn: object, *args: object) -> None:
    """A worker main whose launcher-side sentinel (with ``spawn``: a pipe this process holds) closes a second
    before the process dies: it closes its pipes (not fd 2 and not its launcher watch), then SIGKILLs itself."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    keep = {2, parent.sentinel if parent is not None else -1}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("pipe:") and fd not in keep:
            os.close(fd)
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_whose_sentinel_fires_before_it_exits_is_reported_by_how_it_ended() -> None:
    logs = WorkerLog()
    procs = EngineProcs("sentinel-test", close_pipes_then_die, 1, (), 30.0, logs, ["decode TP rank 0"], 1)
    engine = EngineState(Role.DECODE, 0, procs, ["decode TP rank 0"])
    try:
        with pytest.raises(PDStartError) as err:
            await_ready([engine], 60.0)
        assert str(err.value) == "decode TP rank 0 died while starting (killed by SIGKILL)"
    finally:
        procs.close(0.0)
        logs.close()
    assert forkserver_pid() is not None


WRITER = r"""
import os, sys
os.write(2, b"I0101 10:00:00.000001  4242 transfer_engine.cpp:100] hello\n")
sys.stderr.write("a Python warning line\n"); sys.stderr.flush()
for k in range(3):
    os.write(2, b"E0101 10:00:00.%06d  4242 tcp_transport.cpp:77] Connection refused\n" % k)
os.write(2, b"no newline at the end")
"""


def test_worker_log_routes_mooncake_lines_to_logging_counted_and_passes_the_others_through(
    tmp_path: Path, caplog
) -> None:
    out = tmp_path / "stderr"
    with out.open("wb") as sink:
        logs = WorkerLog(passthrough_fd=sink.fileno())
        writer = logs.pipe("decode TP rank 1")
        with caplog.at_level(logging.DEBUG, logger="hybridkv.transfer.mooncake"):
            proc = subprocess.Popen([sys.executable, "-c", WRITER], stderr=writer.fileno())
            writer.close()
            assert proc.wait(60) == 0
            end = time.monotonic() + 10
            while logs.total < 4 and time.monotonic() < end:
                time.sleep(0.01)
            logs.close()
    assert logs.counts() == {"decode TP rank 1": 4}
    assert out.read_text() == "a Python warning line\nno newline at the end\n"
    records = [r for r in caplog.records if r.name == "hybridkv.transfer.mooncake"]
    assert [r.levelno for r in records].count(logging.DEBUG) == 4
    (warning,) = [r for r in records if r.levelno == logging.WARNING]  # the first line, then rate-limited
    assert "decode TP rank 1: mooncake: I0101" in warning.getMessage() and "hello" in warning.getMessage()


def test_serve_pd_refuses_a_model_dir_without_weights_in_one_line(saved: Path, tmp_path: Path, capsys) -> None:
    model = _copy(saved, tmp_path / "model")
    (model / "model.safetensors").unlink()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n')
    assert main(["serve-pd", "--model", str(model), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no *.safetensors files" in err and err.count("\n") == 1, err


FORKSERVER_CHECK = """
import os
from hybridkv.engine.parallel.forkserver import context, forkserver_threads
ctx = context()
p = ctx.Process(target=os.getpid)  # served once the forkserver has imported everything it preloads
p.start()
p.join(120)
print(p.exitcode, forkserver_threads())
"""


def test_the_forkserver_runs_no_thread_between_forks_even_with_blas_threads_unlimited() -> None:
    # forking a process that runs threads is unsafe: after what it preloads (numpy's OpenBLAS starts a thread
    # server at import unless OMP/OPENBLAS_NUM_THREADS say 1, and stops it before a fork) the forkserver must
    # be single-threaded whenever it forks a worker (a preloaded module that starts threads fails this)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    run = subprocess.run(
        [sys.executable, "-c", FORKSERVER_CHECK], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0 and run.stdout.split() == ["0", "1"], (run.stdout, run.stderr[-2000:])
