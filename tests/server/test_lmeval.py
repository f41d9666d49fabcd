"""lm-evaluation-harness against ``hybridkv serve`` (issue #34): ``lm_eval --model local-completions`` runs a
loglikelihood task (``lmeval_task/``: 32 items x 4 choices) against a tiny random model served with a real
tokenizer, and every loglikelihood it records equals ``transformers``' on the same weights within 1e-4 (fp32), as
do its greedy flags and its accuracy.

lm-eval lives in its own ``.venv-lmeval`` (no torch), made by ``scripts/setup_lmeval.sh`` on first use (about a
minute); where that cannot install, the test skips naming why."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-lmeval"
SETUP = ROOT / "scripts" / "setup_lmeval.sh"
TASK_DIR = Path(__file__).resolve().parent / "lmeval_task"
TASK = "hybridkv_tiny_words"
SETUP_TIMEOUT_S = 300
TOLERANCE = 1e-4
IGNORED = "hybridkv_ignored_request_fields_total{"


@pytest.fixture(scope="module")
def lm_eval() -> Path:
    """``.venv-lmeval/bin/lm_eval``, installed first where it is not (the script is a no-op once it has been)."""
    try:
        done = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"lm-eval not installed: {SETUP.name} ran past {SETUP_TIMEOUT_S} s")
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        pytest.skip(f"lm-eval not installed: {why}")
    return VENV / "bin" / "lm_eval"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridkv.testing.tiny_tokenizer import save_tiny_model

    directory = tmp_path_factory.mktemp("lmeval") / "tiny"
    save_tiny_model(directory)
    return directory


@contextlib.contextmanager
def serving(model: Path, logs: Path) -> Iterator[str]:
    """``hybridkv serve --model MODEL --port 0`` in a child process: its URL; SIGTERM and reaped on the way out."""
    out, err = (logs / "serve.out").open("w+"), (logs / "serve.err").open("w+")
    cmd = [sys.executable, "-m", "hybridkv", "serve", "--model", str(model), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None:
            assert proc.poll() is None, f"hybridkv serve exited: {(logs / 'serve.err').read_text()}"
            assert time.monotonic() < deadline, "hybridkv serve did not start in 120 s"
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", (logs / "serve.out").read_text())
            url = found.group(1) if found else None
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
        err.close()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(model_dir, tmp_path_factory.mktemp("serve")) as url:
        yield url


def run_lm_eval(lm_eval: Path, url: str, model: Path, tokenized: bool, out: Path) -> tuple[str, dict[str, Any], list]:
    """Run the task; lm_eval's stdout, its results and its samples (one per item)."""
    args = f"base_url={url}/v1/completions,model={model.name},tokenizer={model},tokenizer_backend=huggingface"
    args += f",tokenized_requests={tokenized},num_concurrent=1,max_retries=1"
    cmd = [str(lm_eval), "--model", "local-completions", "--model_args", args, "--tasks", TASK]
    cmd += ["--include_path", str(TASK_DIR), "--log_samples", "--output_path", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own venv, none of ours
    env |= {"HF_HOME": str(out / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # the task's data file is named relative to the working directory
    done = subprocess.run(cmd, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"lm_eval failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (results,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    (samples,) = glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    with open(samples) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda row: row["doc_id"])
    return done.stdout, json.loads(Path(results).read_text())["results"][TASK], rows


def reference(model: Path, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], tuple[float, bool]]:
    """``transformers``' loglikelihood of each (context, continuation) and whether each continuation token is the
    most likely one, tokenized as lm-eval does (the whole text, split after the context's tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    figures = {}
    with torch.no_grad():
        for context, continuation in pairs:
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            start = len(tokenizer.encode(context, add_special_tokens=False))
            logp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), dim=-1)
            rows = [(logp[p - 1], whole[p]) for p in range(start, len(whole))]
            loglikelihood = sum(float(row[token]) for row, token in rows)
            greedy = all(float(row[token]) >= float(row.max()) - TOLERANCE for row, token in rows)
            figures[context, continuation] = (loglikelihood, greedy)
    return figures


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_lm_eval_loglikelihoods_equal_transformers(
    lm_eval: Path, server: str, model_dir: Path, tokenized: bool, tmp_path: Path
) -> None:
    stdout, results, samples = run_lm_eval(lm_eval, server, model_dir, tokenized, tmp_path / "out")
    assert len(samples) == 32
    pairs = [(arg["arg_0"], arg["arg_1"]) for row in samples for arg in row["arguments"].values()]
    want = reference(model_dir, pairs)
    correct = 0
    for row in samples:
        got = [(float(lp), greedy == "True") for ((lp, greedy),) in row["resps"]]
        expected = [want[arg["arg_0"], arg["arg_1"]] for arg in row["arguments"].values()]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected], abs=TOLERANCE), row["doc"]
        assert [g for _, g in got] == [g for _, g in expected], row["doc"]
        ranked = sorted(lp for lp, _ in expected)
        assert ranked[-1] - ranked[-2] > 2 * TOLERANCE  # the best choice is the same on both sides of the tolerance
        hit = max(range(len(expected)), key=lambda i: expected[i][0]) == int(row["target"])
        assert row["acc"] == float(hit)
        correct += hit
    accuracy = correct / len(samples)
    assert results["acc,none"] == pytest.approx(accuracy)
    assert re.search(rf"\|{TASK}\s*\|.*\|acc\s*\|.*\|{accuracy:.4f}\|", stdout), stdout  # the figure it printed
    metrics = httpx.get(f"{server}/metrics", timeout=30).text.splitlines()
    ignored = [line for line in metrics if line.startswith(IGNORED)]
    assert ignored == []  # every field lm-eval sends is one the server knows


def test_the_word_tokenizer_fits_the_vocabulary_and_splits_exactly(model_dir: Path) -> None:
    """Without lm-eval: the saved tokenizer's ids, its context/continuation split, and the task's words."""
    from transformers import AutoTokenizer

    from hybridkv.engine.random_models import VOCAB
    from hybridkv.testing.tiny_tokenizer import SPECIALS, WORDS, word_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tokenizer) == len(SPECIALS) + len(WORDS) <= VOCAB
    text = "the cat sat on the red bed"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == [len(SPECIALS) + WORDS.index(word) for word in text.split()] and tokenizer.decode(ids) == text
    assert ids == tokenizer.encode("the cat sat on the", add_special_tokens=False) + tokenizer.encode(" red bed")
    assert tokenizer.encode("zebra", add_special_tokens=False) == [tokenizer.unk_token_id]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 2, None)
    for line in (TASK_DIR / "tiny_words.jsonl").read_text().splitlines():
        item = json.loads(line)
        assert set(item["context"].split()) | set(item["choices"]) <= set(WORDS), item
        assert len(item["choices"]) == 4 and 0 <= item["gold"] < 4
    with pytest.raises(ValueError, match="exceed 256 ids"):
        word_tokenizer(tuple(f"w{i}" for i in range(254)))
