"""``hybridkv generate``: outputs equal transformers' generate; bad input is one ``error:`` line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.cli import main
from tests.engine.harness import hf_model, hf_reference, prompt

PROMPTS = [prompt(900 + i, 4 + 9 * i) for i in range(5)]


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(args) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_random_model_outputs_equal_transformers_generate(name: str, tmp_path: Path, capsys) -> None:
    file = _jsonl(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in PROMPTS])
    args = ["generate", "--random", name, "--prompts", str(file), "--max-new-tokens", "7", "--chunk-size", "5"]
    report = _run([*args, "--page-size", "4", "--checkpoints", "interval:8,branch,end", "--json"], capsys)
    assert [r["output_ids"] for r in report["requests"]] == [hf_reference(name, tuple(p), 7)[0] for p in PROMPTS]
    assert {r["error"] for r in report["requests"]} == {None}
    totals = report["totals"]
    assert (totals["requests"], totals["errors"]) == (5, 0)
    assert totals["output_tokens"] == sum(len(r["output_ids"]) for r in report["requests"])


def test_model_directory_and_seeded_sampling(tmp_path: Path, capsys) -> None:
    hf_model("tiny-gpt-oss").save_pretrained(tmp_path / "model")
    file = _jsonl(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in PROMPTS])
    base = ["generate", "--model", str(tmp_path / "model"), "--prompts", str(file), "--max-new-tokens", "6"]
    greedy = _run([*base, "--json"], capsys)
    assert [r["output_ids"] for r in greedy["requests"]] == [
        hf_reference("tiny-gpt-oss", tuple(p), 6)[0] for p in PROMPTS
    ]
    sampled = [_run([*base, "--temperature", "1", "--seed", str(s), "--json"], capsys) for s in (3, 3, 4)]
    assert sampled[0]["requests"] == sampled[1]["requests"] != sampled[2]["requests"]

    assert main(base) == 0  # the text form: one line per request, then the totals
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(PROMPTS) + 1 and lines[0].startswith("request 0 (4 prompt tokens, ")


def test_batching_options_change_the_steps_not_the_tokens(tmp_path: Path, capsys) -> None:
    file = _jsonl(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in PROMPTS])
    args = ["generate", "--random", "tiny-qwen3-next", "--prompts", str(file), "--max-new-tokens", "4"]
    args += ["--chunk-size", "5", "--page-size", "4", "--json"]
    default, one, small = (
        _run([*args, *extra], capsys) for extra in ([], ["--max-running", "1"], ["--max-step-tokens", "3"])
    )
    assert [r["output_ids"] for r in one["requests"]] == [r["output_ids"] for r in default["requests"]]
    assert [r["output_ids"] for r in small["requests"]] == [r["output_ids"] for r in default["requests"]]
    assert one["totals"]["steps"] > default["totals"]["steps"]  # one request at a time
    fed = (
        sum(map(len, PROMPTS)) + len(PROMPTS) * 3
    )  # prompts + every new token but the last (distinct prompts: no hits)
    assert small["totals"]["steps"] >= fed / 3 > default["totals"]["steps"]  # at most 3 tokens a step


def test_shared_prefixes_hit_the_cache_unless_no_prefix_cache(tmp_path: Path, capsys) -> None:
    shared = prompt(950, 30)
    prompts = [shared + prompt(960 + i, 2 + i) for i in range(8)]
    file = _jsonl(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in prompts])
    args = ["generate", "--random", "tiny-gpt-oss", "--prompts", str(file), "--max-new-tokens", "5"]
    args += ["--chunk-size", "5", "--page-size", "4", "--json"]
    cached, plain = _run(args, capsys), _run([*args, "--no-prefix-cache"], capsys)
    reference = [hf_reference("tiny-gpt-oss", tuple(p), 5)[0] for p in prompts]
    assert [r["output_ids"] for r in cached["requests"]] == [r["output_ids"] for r in plain["requests"]] == reference
    assert cached["totals"]["cached_tokens"] > 0 and plain["totals"]["cached_tokens"] == 0
    assert cached["totals"]["cached_tokens"] == sum(r["cached_tokens"] for r in cached["requests"])


GOOD = {"prompt_ids": [5, 6, 7]}
BAD_FILES: dict[str, tuple[str, str]] = {
    "not_json.jsonl": ('{"prompt_ids": [5, 6, 7]}\n{"prompt_ids": [1,', ":2: not a prompt line"),
    "schema.jsonl": ('{"ids": [5]}', ":1: not a prompt line"),
    "string_id.jsonl": ('{"prompt_ids": [5, "6"]}', "Expected `int`, got `str`"),
    "fraction.jsonl": ('{"prompt_ids": [5, 6.5]}', "Expected `int`"),
    "extra_field.jsonl": ('{"prompt_ids": [5], "max_tokens": 3}', "unknown field"),
    "binary.jsonl": ("\x00\xff garbage", "not a prompt line"),
    "empty.jsonl": ("\n\n", "holds no prompts"),
    "empty_prompt.jsonl": (json.dumps(GOOD) + '\n{"prompt_ids": []}', ":2: empty prompt: give at least one token"),
    "vocab.jsonl": ('{"prompt_ids": [5, 256]}\n{"prompt_ids": [-1]}', "outside the vocabulary [0, 256) (and 1 more"),
    "too_long.jsonl": (json.dumps({"prompt_ids": [5] * 600}), "exceeds the context of 512 tokens"),
}
RANDOM = ["generate", "--random", "tiny-gemma3", "--max-new-tokens", "4"]


def _bad_cases(tmp: Path) -> list[tuple[list[str], str]]:
    good = _jsonl(tmp / "good.jsonl", [GOOD])
    (tmp / "no_config").mkdir()
    cases: list[tuple[list[str], str]] = [
        ([*RANDOM, "--prompts", str(tmp / "missing.jsonl")], "does not exist"),
        ([*RANDOM, "--prompts", str(tmp)], "is a directory"),
        (["generate", "--model", str(tmp / "nowhere"), "--prompts", str(good)], "does not exist"),
        (["generate", "--model", str(tmp / "no_config"), "--prompts", str(good)], "no config.json"),
        (["generate", "--prompts", str(good)], "exactly one of --model DIR and --random NAME"),
        ([*RANDOM, "--model", str(tmp / "no_config"), "--prompts", str(good)], "exactly one of"),
        (["generate", "--random", "tiny-llama", "--prompts", str(good)], "choose one of tiny-qwen3-next"),
        ([*RANDOM, "--prompts", str(good), "--max-new-tokens", "0"], "--max-new-tokens"),
        ([*RANDOM, "--prompts", str(good), "--page-size", "0"], "--page-size"),
        ([*RANDOM, "--prompts", str(good), "--chunk-size", "-3"], "--chunk-size"),
        ([*RANDOM, "--prompts", str(good), "--temperature", "-1"], "--temperature"),
        ([*RANDOM, "--prompts", str(good), "--gpu-memory", "lots"], "cannot read 'lots'"),
        ([*RANDOM, "--prompts", str(good), "--checkpoints", "interval:6"], "positive multiple of the page size 16"),
        ([*RANDOM, "--prompts", str(good), "--checkpoints", "often"], "unknown checkpoint placement 'often'"),
        ([*RANDOM, "--prompts", str(good), "--gpu-memory", "20KiB"], "one request of 7 tokens needs"),
    ]
    for name, (text, says) in BAD_FILES.items():
        (tmp / name).write_bytes(text.encode("utf-8", "surrogateescape"))
        cases.append(([*RANDOM, "--prompts", str(tmp / name)], says))
    return cases


def test_bad_input_is_one_error_line_and_exit_2(tmp_path: Path, capsys) -> None:
    for args, says in _bad_cases(tmp_path):
        assert main(args) == 2, args
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, err)
        assert says in lines[0], (args, lines[0])
        assert "Traceback" not in out + err


def test_demo_engine_section_prints_every_request_matching_transformers() -> None:
    import io

    from rich.console import Console

    from hybridkv.cli.demo import engine_section

    text = io.StringIO()
    report = engine_section(Console(file=text, width=200))
    rows = report["requests"]
    assert isinstance(rows, list) and len(rows) == 4 and all(r["match"] for r in rows)
    assert text.getvalue().count("match") == 4 and "MISMATCH" not in text.getvalue()
    assert "4/4 requests token-exact" in text.getvalue()
