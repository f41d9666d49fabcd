"""Disaggregated serving in real processes: PP prefill stages -> TP decode ranks over shm, token-exact.

(PP 2) -> (TP 2) for Qwen3-Next (GDN + full attention), Gemma 3 (sliding window 8) and
Kimi-Linear (KDA + MLA); (PP 3) -> (TP 1) for Qwen3-Next. Per model, 3 requests (one
sharing a prefix with another; lengths around and past the sliding window of 8) are
prefilled in chunks of 5 over pages of 4 by the pipeline-stage processes, handed over with
``hybridkv.transfer`` (authenticated control plane with a fresh key, shm transport) to the
decode processes, which decode 5 tokens greedily. Checked: every request's tokens equal the
single-process engine's and ``transformers``' (up to its EOS); per-request timings are
present and ordered (one request at a time); every process ends with no
live page or slot; no process outlives the run.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from hybridkv.engine.disagg import PDConfig, run_pd
from tests.engine.harness import hf_model, hf_reference, make_runner, prompt, serve

PAGE, CHUNK, MAX_NEW = 4, 5, 5
BASE = prompt(11, 13)
PROMPTS = (tuple(BASE), tuple(BASE + prompt(12, 9)), tuple(prompt(13, 6)))


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize(
    ("name", "pp", "tp"),
    [("tiny-qwen3-next", 2, 2), ("tiny-gemma3", 2, 2), ("tiny-kimi-linear", 2, 2), ("tiny-qwen3-next", 3, 1)],
)
def test_pp_prefill_to_tp_decode_serves_the_single_process_and_transformers_tokens(
    name: str, pp: int, tp: int, tmp_path: Path
) -> None:
    hf_model(name).save_pretrained(tmp_path)
    config = PDConfig(
        str(tmp_path), PROMPTS, MAX_NEW, prefill_pp=pp, decode_tp=tp, page_size=PAGE, chunk=CHUNK, gpu_memory=3_000_000
    )
    result = run_pd(config)
    single = serve(make_runner(name, PAGE), [list(p) for p in PROMPTS], CHUNK, MAX_NEW)
    for i, ids in enumerate(PROMPTS):
        assert result.output_ids[i] == single[i].tokens, f"{name} request {i}"
        hf_tokens, _ = hf_reference(name, ids, MAX_NEW)
        assert result.output_ids[i][: len(hf_tokens)] == hf_tokens, f"{name} request {i} vs transformers"
    roles = sorted((r.role, r.index) for r in result.ranks)
    assert roles == [("decode", r) for r in range(tp)] + [("prefill", s) for s in range(pp)]
    for r in result.ranks:
        assert r.live_after == r.live_before, f"{r.role} {r.index}: pages/slots still live"
        assert all(n > 0 for n in r.transfer_bytes), f"{r.role} {r.index}: a request moved no bytes"
        assert _gone(r.pid) and r.pid != os.getpid()
    last = next(r for r in result.ranks if r.role == "prefill" and r.index == pp - 1)
    assert [t[0] for t in result.output_ids] == list(last.output_ids[0])  # decode starts from prefill's token
    timings = result.timings
    assert len(timings) == len(PROMPTS)
    for t in timings:
        assert t.queue_s >= 0 and t.prefill_s > 0 and t.transfer_s >= 0 and t.decode_s > 0, t
        assert t.ttft_s == pytest.approx(t.queue_s + t.prefill_s) and t.tpot_s == pytest.approx(t.decode_s / 4)
    # one request at a time on every stage: a later request starts and gets its first token later
    assert all(b.queue_s > a.queue_s and b.ttft_s > a.ttft_s for a, b in itertools.pairwise(timings))


def test_serve_pd_cli_prints_generates_output_ids_with_ordered_timings(tmp_path: Path, capsys) -> None:
    from hybridkv.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": list(p)}) + "\n" for p in PROMPTS))
    common = ["--random", "tiny-qwen3-next", "--prompts", str(prompts), "--max-new-tokens", str(MAX_NEW), "--json"]
    assert main(["generate", *common]) == 0
    generated = json.loads(capsys.readouterr().out)
    pd = ["--prefill-pp", "2", "--decode-tp", "2", "--transport", "shm", "--page-size", str(PAGE)]
    assert main(["serve-pd", *common, *pd, "--chunk-size", str(CHUNK)]) == 0
    out, err = capsys.readouterr()
    served = json.loads(out)
    assert "Writing" not in err, err
    assert served["model"] == "tiny-qwen3-next" and served["totals"]["requests"] == len(PROMPTS)
    assert [r["output_ids"] for r in served["requests"]] == [r["output_ids"] for r in generated["requests"]]
    assert [r["finish_reason"] for r in served["requests"]] == [r["finish_reason"] for r in generated["requests"]]
    for r in served["requests"]:
        t = r["timings"]
        assert t["ttft_s"] > 0 and t["prefill_s"] > 0 and t["queue_s"] >= 0, t
        assert t["transfer_s"] >= 0 and t["decode_s"] >= 0 and t["tpot_s"] >= 0, t
        assert t["ttft_s"] == pytest.approx(t["queue_s"] + t["prefill_s"], abs=1e-5)
    assert [r["timings"]["queue_s"] for r in served["requests"]] == sorted(
        r["timings"]["queue_s"] for r in served["requests"]
    )
