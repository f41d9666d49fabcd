"""``hybridkv serve`` refuses bad options with one ``error:`` line and exit 2, before loading a model."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hybridkv.cli import main


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "give exactly one of --model DIR and --random NAME"),
        (["--random", "tiny-nothing"], "not a tiny random model"),
        (["--random", "tiny-qwen3-next", "--port", "70000"], "--port"),
        (["--random", "tiny-qwen3-next", "--gpu-memory", "lots"], "--gpu-memory"),
        (["--random", "tiny-qwen3-next", "--shutdown-timeout", "nan"], "--shutdown-timeout"),
        (["--random", "tiny-qwen3-next", "--tokenizer", "/nonexistent"], "--tokenizer"),
        (["--random", "tiny-qwen3-next", "--max-header", "100"], "at least 1 KiB"),
        (["--random", "tiny-qwen3-next", "--max-header", "lots"], "--max-header"),
        (["--random", "tiny-qwen3-next", "--header-timeout", "0"], "--header-timeout"),
        (["--random", "tiny-qwen3-next", "--max-connections", "0"], "--max-connections"),
        (["--random", "tiny-qwen3-next", "--gather-ms", "-1"], "--gather-ms"),
        (["--random", "tiny-qwen3-next", "--gather-ms", "51"], "--gather-ms"),
        (
            ["--random", "tiny-qwen3-next", "--disaggregated", "--gather-ms", "2"],
            "the PD server's router takes requests as they come: drop it",
        ),
        (
            ["--random", "tiny-qwen3-next", "--decode-tp", "2"],
            "--decode-tp configures the PD server: add --disaggregated",
        ),
        (["--random", "tiny-qwen3-next", "--disaggregated", "--transport", "pigeon"], "unknown transport 'pigeon'"),
        (["--random", "tiny-qwen3-next", "--disaggregated", "--fault", "explode:1"], "unknown fault 'explode'"),
        (["--random", "tiny-qwen3-next", "--disaggregated", "--fault", "kill-decode:x"], "'kill-decode:x'"),
        # refused by the layout check, before any process starts
        (["--random", "tiny-qwen3-next", "--disaggregated", "--fault", "kill-decode:0:5"], "rank 5 does not exist"),
        (["--random", "tiny-qwen3-next", "--disaggregated", "--prefill-pp", "64"], "64"),
    ],
)
def test_bad_options_are_one_error_line(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err


def test_a_taken_port_fails_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--random", "tiny-qwen3-next", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_the_tokenizer_is_the_option_else_the_model_directory_s_own_else_bytes_for_a_random_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hybridkv.cli.serve import text_tokenizer
    from hybridkv.engine.random_models import save_random
    from hybridkv.server import ByteTokenizer, Tokenizer

    model = tmp_path / "model"
    save_random("tiny-qwen3-next", str(model))
    assert text_tokenizer(None, model, None) is None  # no tokenizer files: token ids only
    raw = RawTokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(str(model))
    own = text_tokenizer(None, model, None)
    assert isinstance(own, Tokenizer) and own.source == str(model) and own.encode("w7 w9") == [7, 9]
    other = tmp_path / "other"
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(str(other))
    assert text_tokenizer(other, model, None).source == str(other)  # type: ignore[union-attr]  # the option wins
    byte = text_tokenizer(None, None, "tiny-gemma3")
    assert isinstance(byte, ByteTokenizer) and byte.special == {1, 2}  # its bos and eos: no text
    assert byte.decode([104, 1, 105, 2]) == "hi" and byte.encode("hé") == [104, 0xC3, 0xA9]
    (model / "tokenizer.json").write_text("{not json")  # a model directory's broken tokenizer: one error line
    assert main(["serve", "--model", str(model), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot load a tokenizer from") and err.count("\n") == 1
