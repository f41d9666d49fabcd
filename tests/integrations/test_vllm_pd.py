"""vLLM PD mode end to end: a prefill vLLM and a decode vLLM (HybridKVPDConnector) behind hybridkv's proxy.

One shared fixture per model starts ``vllm serve`` processes from ``HYBRIDKV_VLLM_PYTHON`` (as
``test_vllm_connector``): prefill (``kv_producer``) and decode (``kv_consumer``), plus ``vllm.LLM``
without any connector for the reference tokens; for Gemma 3 (tiny, seeded, fp32: a sliding-window
group and a full group) also a second decode whose block size differs (64); for Qwen3-Next (tiny, bf16:
a GDN state group and a full group) a second decode that zeroes the states it loaded (the control,
``vllm_pd_zero_state``). Skipped with one line without the vLLM python or
without the ``mooncake`` package (the transfer engine; vLLM's python imports this venv's).

Proved: through the proxy the decode server's greedy tokens equal the reference and the prompts came
from the prefill server (``vllm:external_prefix_cache_hits``: the first prompt whole, later ones what the
decode's own prefix cache misses; Qwen3-Next: all but the last token, whose state moved); against the
mismatched decode every transfer is refused before a byte moves, with an error naming both sides, and
vLLM recomputes (tokens still equal); a transfer that cannot be served (params already used: the
prefill side freed those blocks) is reported failed and recomputed; params of another prompt load
nothing; the same transfers with the loaded states zeroed change tokens (the equality rests on them).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hybridkv.integrations.vllm.pd_proxy import PDProxy, post
from tests.integrations.test_vllm_connector import ROOT, TIMEOUT_S, vllm_python

DRIVER = Path(__file__).with_name("vllm_pd_driver.py")
VOCAB = 512
HITS = "vllm:external_prefix_cache_hits_total{"


MODELS = {"gemma3": ("float32", 32), "qwen3next": ("bfloat16", 64)}
"""Per model: dtype and block size (vLLM raises the tiny Qwen3-Next's to 64 so a page holds a GDN state)."""


@dataclass
class Cluster:
    kind: str
    block: int
    prefill: str
    decode: str
    odd_decode: str
    """Gemma 3 only: a decode server with another block size (64): its layout does not pair with the prefill's."""
    zero_decode: str
    """Qwen3-Next only: a decode server that zeroes the states it loaded (the control)."""
    logs: dict[str, Path]
    reference: dict[str, list[list[int]]]
    prompts: dict[str, list[list[int]]]

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(5 * 32 + 3)]
    return [prefix + [rng.randrange(1, VOCAB) for _ in range(5 + 3 * i)] for i in range(count)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def serve(
    python: Path, model: Path, port: int, role: str, extra: dict[str, Any], dtype: str, block: int, zero: bool = False
) -> list[str]:
    """``zero``: the decode side's test double that zeroes the states it loaded (``vllm_pd_zero_state``)."""
    config = {
        "kv_connector": "ZeroStatePDConnector" if zero else "HybridKVPDConnector",
        "kv_connector_module_path": "vllm_pd_zero_state" if zero else "hybridkv.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "m",
        "--dtype", dtype,
        "--enforce-eager", "--enable-prefix-caching", "--block-size", str(block), "--max-model-len", "4096",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "96", "--skip-tokenizer-init", "--seed", "0",
        "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
        "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """``request.param``: the model (``MODELS``); Gemma 3 also gets the mismatched decode server."""
    kind: str = request.param
    dtype, block = MODELS[kind]
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("no mooncake package here (pip install hybridkv[mooncake]): PD mode's transfer engine")
    tmp = tmp_path_factory.mktemp(f"vllm-pd-{kind}")
    link = tmp / "mooncake-only"  # this venv's mooncake, alone, importable by vLLM's python
    link.mkdir()
    (link / "mooncake").symlink_to(next(iter(spec.submodule_search_locations)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "integrations"), str(link)]),
        "HYBRIDKV_CLUSTER_KEY": secrets.token_hex(32),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    model = tmp / "model"
    subprocess.run([str(python), str(DRIVER), "build", kind, str(model)], env=env, check=True, timeout=600)
    sets = {"pd": prompts(7, 4)}
    servers = ["prefill", "decode"]
    if kind == "gemma3":
        sets.update(odd=prompts(9, 2), stale=prompts(11, 1) + prompts(12, 1))
        servers.append("odd_decode")
    else:
        servers.append("zero_decode")
    (tmp / "prompts.json").write_text(json.dumps([p for v in sets.values() for p in v]))
    ports = {name: free_port() for name in servers}
    wait = {"pd_wait_s": 20}
    listen = {"pd_port": free_port(), **wait}
    cmds = {
        "prefill": serve(python, model, ports["prefill"], "kv_producer", listen, dtype, block),
        "decode": serve(python, model, ports["decode"], "kv_consumer", wait, dtype, block),
        "reference": [str(python), str(DRIVER), "reference", kind, str(model), str(tmp / "prompts.json"), str(tmp/"r")],
    }  # fmt: skip
    if kind == "gemma3":
        cmds["odd_decode"] = serve(python, model, ports["odd_decode"], "kv_consumer", wait, dtype, 2 * block)
    else:
        cmds["zero_decode"] = serve(python, model, ports["zero_decode"], "kv_consumer", wait, dtype, block, zero=True)
    logs = {name: tmp / f"{name}.log" for name in cmds}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, cmd in cmds.items():
            with open(logs[name], "wb") as f:
                procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        deadline = time.monotonic() + TIMEOUT_S
        while not all(healthy(u) for u in urls.values()) or procs["reference"].poll() is None:
            dead = [n for n, p in procs.items() if p.poll() not in (None, 0) or (n != "reference" and p.poll() == 0)]
            if dead or time.monotonic() > deadline:
                what = dead[0] if dead else "startup"
                tail = logs[dead[0]].read_text(errors="replace")[-3000:] if dead else ""
                pytest.fail(f"vLLM PD {what} {'exited' if dead else 'timed out'}:\n{tail}")
            time.sleep(2)
        flat = json.loads((tmp / "r").read_text())
        reference, i = {}, 0
        for name, ps in sets.items():
            reference[name], i = flat[i : i + len(ps)], i + len(ps)
        yield Cluster(
            kind, block, urls["prefill"], urls["decode"], urls.get("odd_decode", ""), urls.get("zero_decode", ""),
            logs, reference, sets,
        )  # fmt: skip
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, data = post(url + "/v1/completions", {**body, "return_token_ids": True, **extra}, 300)
    assert status == 200, data[:2000]
    out: dict[str, Any] = json.loads(data)
    return out


def stream_text(url: str, prompt: list[int]) -> str:
    """The text of a streamed completion, joined from its server-sent events."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    text = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: {"):
                text.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
    return "".join(text)


def tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def external_hits(url: str) -> float:
    """The server's count of prompt tokens a connector answered (``vllm:external_prefix_cache_hits``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(HITS))


@pytest.mark.parametrize("cluster", list(MODELS), indirect=True)
def test_two_vllm_processes_give_the_tokens_of_one(cluster: Cluster) -> None:
    proxy = PDProxy(cluster.prefill, cluster.decode).start()
    answers, hits = [], [external_hits(cluster.decode)]
    try:
        for p in cluster.prompts["pd"]:
            answers.append(complete(proxy.address, p))
            hits.append(external_hits(cluster.decode))
        streamed = stream_text(proxy.address, cluster.prompts["pd"][0])  # after the counts: its hits are not counted
    finally:
        proxy.close()
    assert [tokens(a) for a in answers] == cluster.reference["pd"]
    assert streamed == answers[0]["choices"][0]["text"]  # the decode server's events, relayed through the proxy
    assert proxy.stats == {"requests": 5, "with_params": 5, "prefill_failed": 0}  # 4 + the streamed one
    # the decode server loaded the prompts from the prefill server: the first wholly, the later ones their
    # tails after the shared prefix the decode's own prefix cache holds; and no load failed. With a state
    # group the prefill stops one token short (the state after it moves) and the decode computes that token;
    # its prefix cache then holds no state at a block boundary of the shared prefix: every prompt loads whole
    short = cluster.kind == "qwen3next"
    shared = 0 if short else (5 * 32 + 3) // cluster.block * cluster.block
    loaded = [b - a for a, b in itertools.pairwise(hits)]
    first, *later = cluster.prompts["pd"]
    assert loaded == [len(first) - short] + [len(p) - short - shared for p in later], hits
    assert "not loaded" not in cluster.log("decode")


@pytest.mark.parametrize("cluster", ["gemma3"], indirect=True)
def test_a_mismatched_decode_is_refused_and_recomputes(cluster: Cluster) -> None:
    proxy = PDProxy(cluster.prefill, cluster.odd_decode).start()
    try:
        answers = [complete(proxy.address, p) for p in cluster.prompts["odd"]]
    finally:
        proxy.close()
    assert [tokens(a) for a in answers] == cluster.reference["odd"]  # recomputed on the decode side
    log = cluster.log("odd_decode")
    assert log.count("not loaded (vLLM recomputes it): page size mismatch: prefill") == 2, log[-3000:]
    assert "(1, 32, 64), 8192 B per page), decode" in log and "(1, 64, 64), 16384 B per page)" in log
    assert "refused: page size mismatch" in cluster.log("prefill")


@pytest.mark.parametrize("cluster", ["gemma3"], indirect=True)
def test_a_broken_transfer_is_recomputed(cluster: Cluster) -> None:
    first, other = cluster.prompts["stale"]
    ref_first, ref_other = cluster.reference["stale"]

    def prefill(prompt: list[int]) -> dict[str, Any]:
        answer = complete(cluster.prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        kv: dict[str, Any] = answer["kv_transfer_params"]
        assert kv["do_remote_prefill"] and kv["remote_endpoint"].startswith("tcp://")
        return kv

    kv = prefill(first)
    assert tokens(complete(cluster.decode, first, kv_transfer_params=dict(kv))) == ref_first
    # the same params again: the prefill side freed those blocks after sending them; the load of the part
    # the decode's prefix cache misses is refused, and vLLM recomputes it
    assert tokens(complete(cluster.decode, first, kv_transfer_params=dict(kv))) == ref_first
    assert f"not loaded (vLLM recomputes it): request {kv['remote_request_id']} is no longer held by prefill" in (
        cluster.log("decode")
    )
    # params of another prompt (of the same length): nothing loaded, the prompt computed on the decode side,
    # and the prefill side told to free those blocks (a later load of them is refused: "it was sent")
    kv = prefill(first)
    assert tokens(complete(cluster.decode, other, kv_transfer_params=dict(kv))) == ref_other
    assert "kv_transfer_params describe another prompt (168 tokens, this one 168)" in cluster.log("decode")
    assert tokens(complete(cluster.decode, first, kv_transfer_params=dict(kv))) == ref_first
    assert cluster.log("decode").count("is no longer held by prefill") == 2


@pytest.mark.parametrize("cluster", ["qwen3next"], indirect=True)
def test_the_equality_rests_on_the_moved_state(cluster: Cluster) -> None:
    """The control: the same transfers into a decode server that zeroes each loaded state block before vLLM
    reads it (a PD connector moving the KV but not the state) give other tokens."""
    proxy = PDProxy(cluster.prefill, cluster.zero_decode).start()
    before = external_hits(cluster.zero_decode)
    try:
        answers = [complete(proxy.address, p) for p in cluster.prompts["pd"]]
    finally:
        proxy.close()
    assert external_hits(cluster.zero_decode) - before == sum(len(p) - 1 for p in cluster.prompts["pd"])
    assert "not loaded" not in cluster.log("zero_decode")
    differ = sum(tokens(a) != ref for a, ref in zip(answers, cluster.reference["pd"], strict=True))
    assert differ > 0, "zeroed states gave the reference tokens: the state-group equality proves nothing"
    print(json.dumps({"zeroed_state_prompts_differing": differ, "of": len(answers)}), file=sys.stderr)
