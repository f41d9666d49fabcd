"""Disaggregated serving in real processes: a router, a PP x TP prefill world and a TP decode world, token-exact.

(PP 2, TP 1) -> (TP 2) for Qwen3-Next (GDN + full attention), Gemma 3 (sliding window 8) and
Kimi-Linear (KDA + MLA) over shm, Gemma 3 and Kimi-Linear also over Mooncake (TCP on 127.0.0.1;
the ``serve-pd`` test runs Qwen3-Next over Mooncake); (PP 3) -> (TP 1) for Qwen3-Next and
(PP 1, TP 2) -> (TP 1) for Kimi-Linear over shm.
Per layout, one server launch serves 8 requests (the first alone, then seven submitted at once:
four share its prefix, lengths around and past the sliding window of 8), prefilled in chunks of 5
over pages of 4, batched across requests, with the prefill prefix cache on, handed over with
``hybridkv.transfer`` and decoded (5 tokens, greedy, EOS ignored, continuous batching on the
decode TP ranks). Checked: every request finished with the single-process engine's and
``transformers``' tokens (up to its EOS); the shared-prefix requests hit the prefill cache and
still moved their whole KV/state; every worker ends with the live pages and slots it started
with; no process or shared-memory file outlives the server.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.disagg import FINISHED, PD_ENGINE, PDConfig, PDServer, WorkerState, run_pd
from hybridkv.engine.engine import Engine
from hybridkv.engine.sched.request import Outcome, SamplingParams
from tests.engine.harness import hf_model, hf_reference, make_runner, prompt, serve

PAGE, CHUNK, MAX_NEW = 4, 5, 5
BASE = prompt(11, 13)
PROMPTS = (
    tuple(BASE),
    tuple(BASE + prompt(12, 9)),
    tuple(prompt(13, 6)),
    tuple(BASE + prompt(14, 4)),
    tuple(prompt(15, 11)),
    tuple(BASE[:9] + prompt(16, 5)),
    tuple(prompt(13, 6) + prompt(17, 7)),
    tuple(BASE + prompt(12, 9) + prompt(18, 3)),
)
SHARED = (1, 3, 7)  # start with BASE, submitted after the request that is BASE finished: they hit the prefill cache


def settled(server: PDServer, wait_s: float = 15.0) -> list[WorkerState]:
    """Probe every live worker until each is idle and holds exactly what it held before its first request
    (a failed transfer's pages are freed once its writers are proven gone: not at once)."""
    end = time.monotonic() + wait_s
    while True:
        states = server.probe(timeout_s=60)
        if all(w.requests == 0 and w.live == w.live_before for w in states) or time.monotonic() > end:
            return states
        time.sleep(0.1)


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


LAYOUTS = [  # (name, PP, prefill TP, decode TP, transport): five architectures on both layouts, + PP 3
    ("tiny-qwen3-next", 2, 1, 2, "shm"),
    ("tiny-gemma3", 2, 1, 2, "mooncake"),
    ("tiny-gpt-oss", 2, 1, 2, "shm"),
    ("tiny-nemotron-h", 2, 1, 2, "shm"),
    ("tiny-kimi-linear", 2, 1, 2, "mooncake"),
    ("tiny-qwen3-next", 1, 2, 1, "mooncake"),
    ("tiny-gemma3", 1, 2, 1, "shm"),
    ("tiny-gpt-oss", 1, 2, 1, "shm"),
    ("tiny-nemotron-h", 1, 2, 1, "shm"),
    ("tiny-kimi-linear", 1, 2, 1, "shm"),
    ("tiny-qwen3-next", 3, 1, 1, "shm"),  # its last stage holds no recurrent layer
]
MIXED = [  # 16 requests submitted at once: 4 prefix groups, each served greedy, seeded, top-k/top-p, with stop ids
    tuple(prompt(300 + g, 7 + 3 * g) + prompt(400 + k, 2 + 5 * k)) for g in range(4) for k in range(4)
]


def mixed_params(stop: int) -> list[SamplingParams]:
    """Greedy (ending at EOS), seeded sampling, seeded top-k/top-p, greedy with ``stop`` as a stop id."""
    return [
        [
            SamplingParams(MAX_NEW + 2),
            SamplingParams(MAX_NEW + 2, temperature=0.9, seed=31 + i),
            SamplingParams(MAX_NEW + 2, temperature=1.3, top_k=20, top_p=0.8, seed=57 + i),
            SamplingParams(MAX_NEW + 2, stop_token_ids=(stop,), ignore_eos=True),
        ][i % 4]
        for i in range(len(MIXED))
    ]


def save_with_reachable_eos(name: str, path: Path) -> int:
    """Save ``name`` with an ``eos_token_id`` its greedy outputs reach (so EOS ends some requests inside the
    engine on every layout); returns a second such token for the stop-id requests."""
    hf_model(name).save_pretrained(path)
    engine = Engine(path, config=EngineConfig(gpu_memory=4_000_000, page_size=PAGE, chunk_size=CHUNK, max_context=96))
    greedy = SamplingParams(MAX_NEW + 2, ignore_eos=True)
    outs = engine.generate([list(MIXED[0]), list(MIXED[3])], [greedy, greedy])
    eos, stop = outs[0].output_ids[2], outs[1].output_ids[3]  # request 0 is greedy to EOS, 3 has stop ids
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))
    return stop


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    """Per model name, built once for every layout that serves it: its saved directory (with an EOS its greedy
    outputs reach), the mixed requests' ``SamplingParams`` and the single-process engine's outputs for them."""
    built: dict[str, tuple[Path, list[SamplingParams], list]] = {}

    def get(name: str) -> tuple[Path, list[SamplingParams], list]:
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            params = mixed_params(save_with_reachable_eos(name, path))
            single = Engine(
                path, config=EngineConfig(gpu_memory=4_000_000, page_size=PAGE, chunk_size=CHUNK, max_context=96)
            )
            built[name] = (path, params, single.generate([list(p) for p in MIXED], params))
        return built[name]

    return get


@pytest.mark.parametrize(("name", "pp", "ptp", "tp", "transport"), LAYOUTS)
def test_sixteen_concurrent_mixed_requests_equal_the_single_engine_on_every_layout(
    name: str, pp: int, ptp: int, tp: int, transport: str, mixed_model
) -> None:
    """Greedy, seeded sampling (top-k/top-p too), EOS and stop ids: the disaggregated server ends and samples every
    request inside its one scheduler exactly as ``Engine`` does; prefills are batched across requests."""
    model_dir, params, want = mixed_model(name)
    config = PDConfig(
        str(model_dir),
        prefill_pp=pp,
        prefill_tp=ptp,
        decode_tp=tp,
        transport=transport,
        engine=replace(PD_ENGINE, page_size=PAGE, chunk_size=CHUNK, gpu_memory=3_000_000, max_context=96),
    )
    streamed: dict[int, list[int]] = {i: [] for i in range(len(MIXED))}
    ended: list[Outcome] = []
    with PDServer(config) as server:
        handles = [
            server.submit(ids, p, on_token=streamed[i].append, on_done=ended.append)
            for i, (ids, p) in enumerate(zip(MIXED, params, strict=True))
        ]
        long = server.submit(  # aborted at its first token: freed on both sides, ends "abort"
            MIXED[0], SamplingParams(80, ignore_eos=True), on_token=lambda _t: server.abort(long, "test")
        )
        results = [server.result(h, timeout_s=120) for h in handles]
        aborted = server.result(long, timeout_s=120)
        states = settled(server)
    assert aborted.finish_reason == "abort" and aborted.error == "aborted: test" and aborted.output_ids == []
    assert sorted(r.rid for r in ended) == handles and all(r is results[r.rid] for r in ended)
    assert [r.pd.status for r in results] == [FINISHED] * len(MIXED), [r.error for r in results]
    assert [r.output_ids for r in results] == [o.output_ids for o in want]
    assert [r.finish_reason for r in results] == [o.finish_reason for o in want]
    assert [streamed[i] for i in range(len(MIXED))] == [r.output_ids for r in results]  # each token once, in order
    reasons = {str(r.finish_reason) for r in results}
    assert {"eos", "stop", "length"} <= reasons, reasons
    assert [r.output_ids for r in results[1::4]] != [o.output_ids for o in want[::4]]  # sampling is not greedy
    assert server.deaths == [] and all(w.requests == 0 and w.live == w.live_before for w in states), states
    assert all(r.live_after == r.live_before for r in server.ranks)
    assert all(gone(pid) for pid in server.pids())


def test_a_prefix_served_first_is_hit_and_its_whole_kv_still_moves(tmp_path: Path) -> None:
    """(PP 2, TP 1) -> (TP 2), Qwen3-Next: 8 requests, the first alone then seven at once (four share its
    prefix): token-exact with the single engine and transformers, the shared ones hit the prefill cache and
    still move their whole KV/state; stage and rank accounting; nothing outlives the server."""
    name, pp, ptp, tp, transport = "tiny-qwen3-next", 2, 1, 2, "shm"
    hf_model(name).save_pretrained(tmp_path)
    config = PDConfig(
        str(tmp_path),
        PROMPTS,
        MAX_NEW,
        prefill_pp=pp,
        prefill_tp=ptp,
        decode_tp=tp,
        transport=transport,
        engine=replace(PD_ENGINE, page_size=PAGE, chunk_size=CHUNK, gpu_memory=3_000_000, max_step_tokens=CHUNK + 3),
    )
    result = run_pd(config, SamplingParams(MAX_NEW, ignore_eos=True), alone_first=1)
    single = serve(make_runner(name, PAGE), [list(p) for p in PROMPTS], CHUNK, MAX_NEW)
    for i, ids in enumerate(PROMPTS):
        r = result.requests[i]
        assert r.pd.status == FINISHED and r.pd.attempts == 1, r
        assert result.output_ids[i] == single[i].tokens, f"{name} request {i}"
        hf_tokens, _ = hf_reference(name, ids, MAX_NEW)
        assert result.output_ids[i][: len(hf_tokens)] == hf_tokens, f"{name} request {i} vs transformers"
        assert r.pd.transfer_bytes > 0
    for i in SHARED:  # a hit shortened prefill, and the whole KV/state still moved
        hit = result.requests[i]
        assert hit.cached_tokens >= PAGE, (i, hit)
        assert hit.pd.transfer_bytes > result.requests[0].pd.transfer_bytes
    assert result.requests[0].cached_tokens == 0
    roles = sorted((r.role, r.index, r.tp) for r in result.ranks)
    want = [("decode", t, t) for t in range(tp)] + [("prefill", s, t) for s in range(pp) for t in range(ptp)]
    assert roles == sorted(want)
    for r in result.ranks:
        assert r.live_after == r.live_before, f"{r.role} {r.index}: pages/slots still live"
        assert r.requests == len(PROMPTS) and r.transfer_bytes > 0
    assert result.deaths == []
    assert len(result.pids) == pp * ptp + tp and os.getpid() not in result.pids
    assert all(gone(pid) for pid in result.pids)
    assert len(result.shm_files) == (tp if transport == "shm" else 0)
    assert not any(Path(f).exists() for f in result.shm_files)
    for r in result.requests:  # every prefill rank's compute and send window, every decode rank's bytes
        assert sorted((s.pp, s.tp) for s in r.pd.stages) == [(s, t) for s in range(pp) for t in range(ptp)]
        for s in r.pd.stages:
            assert s.ok and s.nbytes > 0 and s.compute[0] < s.compute[1] <= s.send[0] <= s.send[1], s
            assert 0 < s.ops <= s.nbytes, s  # one op per contiguous run: at least a byte each
        path = r.pd
        assert len(path.decode_bytes) == tp and sum(path.decode_bytes) == path.transfer_bytes
        assert path.transfer_bytes == sum(s.nbytes for s in path.stages)
    for t in result.timings:
        assert t is not None
        assert t.queue_s >= 0 and t.prefill_s > 0 and t.transfer_s >= 0 and t.decode_s > 0, t
        assert t.ttft_s == pytest.approx(t.queue_s + t.prefill_s, abs=1e-6)
        assert t.tpot_s == pytest.approx(t.decode_s / (MAX_NEW - 1))


def test_serve_pd_cli_prints_generates_output_ids_with_status_and_timings(tmp_path: Path, capsys) -> None:
    from hybridkv.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": list(p)}) + "\n" for p in PROMPTS[:3]))
    common = ["--random", "tiny-qwen3-next", "--prompts", str(prompts), "--max-new-tokens", str(MAX_NEW), "--json"]
    assert main(["generate", *common]) == 0
    generated = json.loads(capsys.readouterr().out)
    pd = ["--prefill-pp", "2", "--prefill-tp", "1", "--decode-tp", "2", "--transport", "mooncake"]
    assert main(["serve-pd", *common, *pd, "--page-size", str(PAGE), "--chunk-size", str(CHUNK)]) == 0
    out, err = capsys.readouterr()
    served = json.loads(out)
    assert "Writing" not in err, err
    (sizing,) = [line for line in err.splitlines() if line.startswith("hybridkv serve-pd:")]
    longest = max(map(len, PROMPTS[:3]))
    assert f"max context {longest + MAX_NEW} tokens (longest prompt {longest} + {MAX_NEW} new" in sizing, sizing
    assert "--gpu-memory (default) 256.00 MiB per process" in sizing, sizing
    assert served["model"] == "tiny-qwen3-next" and served["totals"]["requests"] == 3
    assert served["totals"]["errors"] == 0 and served["totals"]["transport"] == "mooncake"
    assert [r["output_ids"] for r in served["requests"]] == [r["output_ids"] for r in generated["requests"]]
    assert [r["finish_reason"] for r in served["requests"]] == [r["finish_reason"] for r in generated["requests"]]
    assert [r["status"] for r in served["requests"]] == [FINISHED] * 3
    # (prefix hits between requests submitted together depend on how prefills are batched: the hit test above)
    for r in served["requests"]:
        t = r["timings"]
        assert r["error"] is None and r["attempts"] == 1 and r["transfer_bytes"] > 0
        assert t["ttft_s"] > 0 and t["prefill_s"] > 0 and t["queue_s"] >= 0, t
        assert t["transfer_s"] >= 0 and t["decode_s"] >= 0 and t["tpot_s"] >= 0, t
        assert t["ttft_s"] == pytest.approx(t["queue_s"] + t["prefill_s"], abs=1e-5)
