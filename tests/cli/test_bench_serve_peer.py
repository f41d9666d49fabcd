"""``hybridkv bench serve --peer vllm``: what runs without vLLM installed (the comparison itself needs
``scripts/setup_vllm.sh`` and minutes; it is a bench, not a test): the skip line, option errors, the
shared model directory, reading each server's hit counter from its ``/metrics``, the third server's
connector config and its prefix-cache reset."""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

import hybridkv.integrations.vllm
from hybridkv.bench.vs_peer import (
    CONNECTOR,
    EXTERNAL_HITS,
    HIT_METRICS,
    PEER_VENV,
    SERVERS,
    connector_config,
    metric_sum,
    reset_prefix_cache,
    save_shared_model,
    start_failure,
)
from hybridkv.cli import main


def test_without_the_peer_venv_it_prints_one_skip_line_and_exits_0(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / PEER_VENV / "bin").mkdir(parents=True)  # a venv whose install never finished: no stamp
    (tmp_path / PEER_VENV / "bin" / "python").touch()
    assert main(["bench", "serve", "--peer", "vllm", "--rounds", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines() == [
        f"bench serve --peer vllm: skipped: no vLLM installed at {tmp_path / PEER_VENV} "
        "(run scripts/setup_vllm.sh from the repository root)"
    ]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--peer", "sglang"], "'sglang' is not a server this bench runs against; choose one of vllm"),
        (["--peer", "vllm", "--url", "http://127.0.0.1:1"], "--peer starts both servers itself; drop --url"),
        (["--peer", "vllm", "--disaggregated"], "drop --disaggregated"),
        (["--peer", "vllm", "--widen", "0"], "--widen"),
        (["--dtype", "float64"], "'float64' is not a dtype"),
    ],
)
def test_bad_peer_options_are_one_error_line_and_exit_2(args, says, capsys):
    assert main(["bench", "serve", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_metric_sum_adds_every_label_set_of_that_metric_only() -> None:
    text = (
        "# HELP vllm:prefix_cache_hits_total hits\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="model"} 96.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="model"} 1.5e2\n'
        'vllm:prefix_cache_queries_total{engine="0"} 400.0\n'
        "hybridkv_prefix_cache_hit_tokens_total 512.0\n"
    )
    assert metric_sum(text, "vllm:prefix_cache_hits_total") == 246.0
    assert metric_sum(text, "hybridkv_prefix_cache_hit_tokens_total") == 512.0
    assert metric_sum(text, "vllm:prefix_cache_hits") == 0.0  # a prefix of a name is not that name


def test_shared_model_directory_holds_the_widened_model_and_a_tokenizer_over_its_ids(tmp_path) -> None:
    from transformers import AutoConfig

    from hybridkv.server.text import Tokenizer

    save_shared_model("tiny-gemma3", 2, 300, str(tmp_path))
    config = AutoConfig.from_pretrained(tmp_path)
    assert (config.vocab_size, config.hidden_size) == (300, 128)  # tiny-gemma3's 64 widened twice
    tokenizer = Tokenizer(tmp_path)  # what hybridkv serve --tokenizer loads
    assert tokenizer.encode("t0 t299 t7") == [0, 299, 7]
    assert tokenizer.decode([5, 299]).split() == ["t5", "t299"]


def test_the_connector_server_is_configured_with_hybridkvs_connector_and_counts_external_hits() -> None:
    config = json.loads(connector_config(1 << 30))
    assert config["kv_connector"] in hybridkv.integrations.vllm.__all__  # what vLLM's loader getattr()s
    assert importlib.import_module(config["kv_connector_module_path"]) is hybridkv.integrations.vllm
    assert (config["kv_role"], config["kv_load_failure_policy"]) == ("kv_both", "recompute")
    assert config["kv_connector_extra_config"] == {"host_bytes": 1 << 30}
    assert SERVERS == ("hybridkv", "vllm", CONNECTOR)
    text = (
        'vllm:prefix_cache_hits_total{engine="0"} 64.0\n'
        'vllm:external_prefix_cache_hits_total{engine="0"} 320.0\n'
        'vllm:external_prefix_cache_queries_total{engine="0"} 400.0\n'
    )
    assert sum(metric_sum(text, m) for m in HIT_METRICS[CONNECTOR]) == 384.0  # vLLM's own + the connector's
    assert metric_sum(text, EXTERNAL_HITS) == 320.0


class _ResetAnswers(BaseHTTPRequestHandler):
    answers: ClassVar[list[tuple[int, bytes]]] = []

    def do_POST(self) -> None:
        code, body = self.answers.pop(0)
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


@contextmanager
def _answering(*answers: tuple[int, bytes]) -> Iterator[str]:
    _ResetAnswers.answers = list(answers)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ResetAnswers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_reset_prefix_cache_retries_a_refusal_and_names_the_dev_mode_when_the_endpoint_is_missing() -> None:
    with _answering((200, b'{"success": false}'), (200, b'{"success": true}')) as url:
        reset_prefix_cache(url)  # blocks still held: refused once, then done
        assert _ResetAnswers.answers == []
    with _answering((404, b"")) as url, pytest.raises(RuntimeError, match=r"answered 404.*VLLM_SERVER_DEV_MODE=1"):
        reset_prefix_cache(url)


VLLM_REFUSED_THE_PAGE_SIZE = """\
(APIServer pid=2812) WARNING 12-06 12:56:43 [system_utils.py:255] Found ulimit of 20000 and failed to automatically \
increase with error current limit exceeds maximum limit.
(Worker pid=2832) ERROR 12-06 12:57:14 [multiproc_executor.py:1063] WorkerProc hit an exception.
(Worker pid=2832) ERROR 12-06 12:57:14 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=2832) ERROR 12-06 12:57:14 [multiproc_executor.py:1063]   File "vllm/v1/worker/utils.py", line 554, in \
select_common_block_size
(Worker pid=2832) ERROR 12-06 12:57:14 [multiproc_executor.py:1063]     raise ValueError(
(Worker pid=2832) ERROR 12-06 12:57:14 [multiproc_executor.py:1063] ValueError: No common block size for 16 \
(CPU_ATTN: [MultipleOf(32)]).
(EngineCore pid=2823) ERROR 12-06 12:57:15 [core.py:1100] EngineCore failed to start.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_a_failed_start_names_vllms_root_cause_and_the_option_to_change() -> None:
    why = start_failure(VLLM_REFUSED_THE_PAGE_SIZE, 16)
    assert why.startswith("ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).")
    assert "--page-size 16" in why
    assert start_failure("RuntimeError: Engine core initialization failed.\n", 16) == (
        "RuntimeError: Engine core initialization failed."
    )
    assert start_failure("no traceback here\nonly its last words", 16) == "no traceback here\nonly its last words"


@pytest.mark.parametrize(("args", "page_size"), [([], 32), (["--page-size", "64"], 64)])
def test_the_peer_bench_pages_by_32_unless_told(args, page_size, tmp_path, monkeypatch, capsys):
    """vLLM's CPU attention refuses 16-token blocks on a CPU without AMX: --peer defaults to 32, which all take."""
    import inspect

    import hybridkv.bench.vs_peer as vs_peer

    given = {}
    signature = inspect.signature(vs_peer.run)

    def fake_run(*positional, **named):
        given["page_size"] = signature.bind(*positional, **named).arguments["page_size"]
        raise ValueError("stop here")

    monkeypatch.setattr(vs_peer, "peer_python", lambda root: (tmp_path / "python", ""))
    monkeypatch.setattr(vs_peer, "run", fake_run)
    assert main(["bench", "serve", "--peer", "vllm", "--rounds", "1", *args]) == 2
    assert given == {"page_size": page_size}
    assert "stop here" in capsys.readouterr().err
