"""One sizing story for every command that builds an engine (issue 19 item 11, ``cli/sizing.py``).

- ``generate --model DIR`` on a model whose maximum context is Kimi-Linear's real 1,048,576 tokens
  (tiny Qwen3-Next: one 1M-token request needs 520 MiB) serves with the default budget: the context
  comes from the work (before: sized for 1M tokens, "does not fit" 256 MiB), and the sizing is one
  line on stderr.
- The rule: the work's context, else the default capped by the model's maximum; ``--max-context``
  above the model's maximum is refused; the default budget is doubled until one request of the
  context fits every rank (and no smaller power of two of it would), a given one is checked.
- ``generate``, ``serve-pd``, ``serve``, ``bench engine``, ``bench pd`` and ``bench serve`` take the
  same four sizing options with the same defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from hybridkv.cli import app, main
from hybridkv.cli.sizing import DEFAULT_CONTEXT, DEFAULT_GPU_MEMORY, Layout, size
from hybridkv.engine.random_models import random_config, save_random
from hybridkv.engine.registry import engine_spec
from hybridkv.memory import LayoutError, MemoryHints, plan_memory

KIMI_MAX = 1_048_576


def _spec(name: str, max_positions: int = KIMI_MAX):
    config = random_config(name)
    config.max_position_embeddings = max_positions
    return engine_spec(config)


def test_generate_on_a_model_with_a_one_million_token_context_sizes_for_the_work(tmp_path: Path, capsys) -> None:
    model = tmp_path / "model"
    save_random("tiny-qwen3-next", str(model))
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = KIMI_MAX
    (model / "config.json").write_text(json.dumps(config))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7, 8, 9]}\n{"prompt_ids": [5, 6, 7]}\n')
    assert main(["generate", "--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [len(r["output_ids"]) for r in json.loads(out)["requests"]] == [4, 4]
    (line,) = err.strip().splitlines()
    assert line.startswith("hybridkv generate: max context 9 tokens (longest prompt 5 + 4 new"), line
    assert "--gpu-memory (default) 256.00 MiB (one 9-token request needs" in line, line


def test_the_context_is_the_work_else_the_default_capped_by_the_model() -> None:
    tiny = engine_spec(random_config("tiny-qwen3-next"))  # max_position_embeddings 512
    assert size("serve", tiny).max_context == 512 and "the model's maximum" in size("serve", tiny).line
    long = size("serve", _spec("tiny-qwen3-next"))
    assert long.max_context == DEFAULT_CONTEXT and long.gpu_memory == DEFAULT_GPU_MEMORY, long
    work = size("generate", tiny, prompt_lengths=[30, 100, 7], max_new_tokens=20)
    assert work.max_context == 120 and "longest prompt 100 + 20 new" in work.line
    assert size("generate", tiny, prompt_lengths=[600], max_new_tokens=20).max_context == 512  # the line is refused
    assert size("generate", tiny, prompt_lengths=[30], max_new_tokens=2, max_context=64).max_context == 64
    with pytest.raises(typer.BadParameter, match="above the model's maximum context of 512 tokens"):
        size("generate", tiny, max_context=513)


def test_the_default_budget_grows_to_the_smallest_doubling_that_holds_one_request_on_every_rank() -> None:
    spec = _spec("tiny-qwen3-next")
    for layout, budget in [(Layout(), 4 * DEFAULT_GPU_MEMORY), (Layout(2, 1, 2), 2 * DEFAULT_GPU_MEMORY)]:
        sizing = size("serve-pd", spec, max_context=KIMI_MAX, layout=layout)
        assert sizing.gpu_memory == budget and "--gpu-memory (sized)" in sizing.line, sizing.line
        shards = layout.shards(spec, 16)
        assert len(shards) == (1 if layout == Layout() else 4)

        def fits(budget: int, shards: list = shards) -> bool:
            try:
                for shard, page in shards:
                    plan_memory(shard, budget, MemoryHints(page_size=page, max_context=KIMI_MAX, chunk_tokens=64))
            except LayoutError:
                return False
            return True

        assert fits(sizing.gpu_memory) and not fits(sizing.gpu_memory // 2)
    with pytest.raises(typer.BadParameter, match="one request of 1048576 tokens needs"):
        size("serve-pd", spec, max_context=KIMI_MAX, gpu_memory="8MiB", layout=Layout(2, 1, 2))


def _options(path: list[str]) -> dict[str, object]:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    return {opt: p.default for p in command.params for opt in p.opts if p.param_type_name == "option"}


@pytest.mark.parametrize(
    "path", [["generate"], ["serve-pd"], ["serve"], ["bench", "engine"], ["bench", "pd"], ["bench", "serve"]]
)
def test_every_command_that_builds_an_engine_takes_the_same_sizing_options(path: list[str]) -> None:
    options = _options(path)
    sizing = {k: options.get(k, "missing") for k in ("--gpu-memory", "--max-context", "--page-size", "--chunk-size")}
    # serve's chunk is resolved when it runs: the step budget (2048) for one engine, 64 with --disaggregated
    chunk = None if path == ["serve"] else 64
    # bench serve's page too: 16, or 32 with --peer (vLLM's CPU attention takes multiples of 32 without AMX)
    page = None if path == ["bench", "serve"] else 16
    assert sizing == {"--gpu-memory": None, "--max-context": None, "--page-size": page, "--chunk-size": chunk}, path
