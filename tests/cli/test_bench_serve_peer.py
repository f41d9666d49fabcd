"""``hybridkv bench serve --peer vllm``: what runs without vLLM installed (the comparison itself needs
``scripts/setup_vllm.sh`` and minutes; it is a bench, not a test): the skip line, option errors, the
shared model directory, and reading each server's hit counter from its ``/metrics``."""

from __future__ import annotations

import pytest

from hybridkv.bench.vs_peer import PEER_VENV, metric_sum, save_shared_model
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
