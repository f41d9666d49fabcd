"""The step's pool I/O: one gather and one store per pool (or per window of layers), stale bytes never reach a result,
layouts checked."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.forward import pool_io
from hybridkv.engine.forward.pool_io import LayoutError, pool_layouts
from hybridkv.engine.forward.step import StepContext
from tests.engine.harness import hf_reference, make_runner, prompt, serve
from tests.engine.test_exact import ATOL


@pytest.mark.parametrize("window", [None, 0, 1], ids=["whole", "one-layer-windows", "windows-across-layers"])
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-next", "tiny-kimi-linear"])
def test_stale_bytes_are_nan_and_serving_stays_exact(
    name: str, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every arena byte starts as 0xFF (a NaN in every float format): slots past a request's last token, the
    padding page and never-written cells must not reach attention (a masked NaN key still poisons softmax), also
    when a step gathers its keys a window of slots at a time (``window``: slots beyond one layer's; every gather
    zeroes them again)."""
    if window is not None:
        monkeypatch.setattr(pool_io, "WORKSPACE_SHARE", 0.0)
        one_layer = pool_io.TokenLayout.window
        monkeypatch.setattr(
            pool_io.TokenLayout, "window", lambda self, pages: min(self.slots, one_layer(self, pages) + window)
        )
    runner = make_runner(name, 16)
    runner.mem.arena.buffer.fill_(0xFF)
    prompts = [prompt(40 + n, n) for n in (3, 17, 30)]
    served = serve(runner, prompts, 7, max_new=4)
    for ids, got in zip(prompts, served, strict=True):
        tokens, logits = hf_reference(name, tuple(ids), 4)
        assert got.tokens[: len(tokens)] == tokens
        diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, logits, strict=False))
        assert diff < ATOL, f"{name}: logits differ by {diff}"


def test_a_token_pool_is_one_grid_of_slots_per_layer() -> None:
    runner = make_runner("tiny-gemma3", 4)
    layouts = pool_layouts(runner.mem)
    assert pool_layouts(runner.mem) is layouts  # read once per memory
    for pool_id, layout in layouts.tokens.items():
        layers = runner.mem.layout(pool_id).layer_ids
        assert layout.slots == 2 * len(layers)
        for layer in layers:
            span = layout.span(layer, ("k", "v"))
            k = runner.mem.view(layer, "k")
            assert layout.grid[:, span.start].data_ptr() == k.data_ptr()  # the same bytes as the layer's view
            v = runner.mem.view(layer, "v")
            assert layout.grid[5, span.start + 1].data_ptr() == v[5].data_ptr()  # v's cell 5 is the next slot
            assert (
                layout.grid[5, span.start + 1].shape == v[5].shape
                and layout.grid[5, span.start + 1].stride() == v[5].stride()
            )
        with pytest.raises(LayoutError, match="keeps no"):
            layout.span(99, ("k", "v"))
        with pytest.raises(LayoutError, match="not adjacent"):
            layout.span(layers[0], ("v", "k"))


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3-next"])
def test_compiled_blocks_stay_exact(name: str) -> None:
    """The optional compiled path (traced by dynamo; the "eager" backend skips inductor's slow code generation)
    keeps the memory-reading mixers eager and gives transformers' tokens; compiling twice is refused."""
    from hybridkv.engine.models.compiled import compile_blocks

    runner = make_runner(name, 16)
    compile_blocks(runner.model, backend="eager")
    with pytest.raises(ValueError, match="compiled already"):
        compile_blocks(runner.model, backend="eager")
    prompts = [prompt(60 + n, n) for n in (5, 19)]
    served = serve(runner, prompts, 7, max_new=3)
    for ids, got in zip(prompts, served, strict=True):
        tokens, logits = hf_reference(name, tuple(ids), 3)
        assert got.tokens[: len(tokens)] == tokens
        assert max(float((a - b).abs().max()) for a, b in zip(got.logits, logits, strict=False)) < ATOL


def test_gemma3_ignores_attention_soft_capping_like_transformers() -> None:
    """Gemma 3 configs carry ``attn_logit_softcapping`` but transformers' Gemma 3 never applies it: neither does
    the engine (capping the logits moved them by 0.055 here)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridkv.engine.random_models import SEED, TINY_CONFIGS, VOCAB
    from hybridkv.engine.registry import engine_spec
    from hybridkv.engine.runner import ShardRunner
    from hybridkv.engine.weights import from_hf_model
    from hybridkv.memory import UnifiedMemory
    from hybridkv.spec import ShardSpec

    model_type, overrides = TINY_CONFIGS["tiny-gemma3"]
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, max_position_embeddings=512, **overrides, attn_logit_softcapping=2.0
    )
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    spec = engine_spec(config, torch.float32)
    mem = UnifiedMemory.create(ShardSpec.whole(spec), 4_000_000, page_size=4, max_context=256, chunk_tokens=64)
    runner = ShardRunner(from_hf_model(hf), mem)
    prompts = [prompt(70 + n, n) for n in (6, 21)]
    served = serve(runner, prompts, 5, max_new=3)
    for ids, got in zip(prompts, served, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, eos_token_id=None)
            logits = hf(out).logits[0, len(ids) - 1 :]
        assert got.tokens == out[0, len(ids) :].tolist()
        assert max(float((a - b).abs().max()) for a, b in zip(got.logits, logits, strict=False)) < ATOL


def test_keys_have_a_spare_column_only_for_attention_sinks() -> None:
    """The spare zero key column past the longest row is gathered only for a model with attention sinks (gpt-oss):
    without them a group's keys end at its longest row's last page, and asking those keys for sinks is refused."""
    from hybridkv.engine.forward.batch import ForwardBatch
    from hybridkv.engine.forward.step import build_step
    from hybridkv.engine.sched.kv import Admission, Budget, RequestKV
    from hybridkv.engine.sched.request import Request, SamplingParams

    assert make_runner("tiny-gpt-oss", 16).model.attention_sinks
    runner = make_runner("tiny-gemma3", 16)
    assert not runner.model.attention_sinks
    kv = RequestKV(runner.mem, prefix_cache=False)
    ids = prompt(3, 32)  # two whole pages: a spare column would need a third
    req = Request(0, list(ids), SamplingParams())
    assert kv.admit(req, Budget(64, alone=True)) is Admission.ADMITTED
    kv.allocate([req], [32])
    batch = ForwardBatch.build([ids], [0], [req.kv.token_locs()])
    full = runner.mem.pool_of_layer(5).pool_id  # Gemma 3's sixth layer attends to the whole context
    with fast_paths(paged_spans=False):  # the gathered keys (read from the pages, nothing is)
        for sinks, width in ((False, 32), (True, 48)):
            keys = build_step(batch, runner.mem, torch.device("cpu"), sinks).tokens[full].parts[0][0]
            assert keys.entries.shape[2] == width and keys.mask.shape[-1] == width
            assert (keys.spare is not None) == sinks
        with pytest.raises(ValueError, match="spare key column"):
            build_step(batch, runner.mem, torch.device("cpu"), sinks=False).tokens[full].parts[0][0].with_sinks(
                torch.zeros(4)
            )
    kv.free(req, cache=False)
    runner.mem.verify()


def test_span_groups_cut_where_the_padding_saved_pays_for_a_group() -> None:
    from hybridkv.engine.forward.step import SPLIT_ROWS, span_groups

    assert span_groups([]) == []
    assert span_groups([7]) == [(0, 1)]
    assert span_groups([64, 64, 60, 48, 20]) == [(0, 5)]  # similar lengths: one group
    assert span_groups([48, 5, 3]) == [(0, 1), (1, 3)]  # 2 * 43 padded rows saved > SPLIT_ROWS
    lengths = [64, 36, 16, 16, 16, 12, 12, 10, 8, 8, 8, 7, 4]  # a step of the bench: tails after prefix hits
    groups = span_groups(lengths)
    assert groups == [(0, 2), (2, 13)]
    cost = sum(SPLIT_ROWS + (b - a) * lengths[a] for a, b in groups)
    assert cost < SPLIT_ROWS + len(lengths) * lengths[0]


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3-next", "tiny-nemotron-h"])
def test_unequal_spans_run_as_separate_groups_and_stay_exact(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 48-token chunk and two short prompts in one step: the short ones are padded to their own longest, not to
    48 (two groups of longer spans), and every request still gets transformers' tokens and logits."""
    import hybridkv.engine.runner as runner_module

    widths: list[list[int]] = []

    def spy(*args: Any) -> StepContext:
        ctx = build_step(*args)
        widths.append([g.width for g in ctx.groups])
        return ctx

    build_step = runner_module.build_step
    monkeypatch.setattr(runner_module, "build_step", spy)
    runner = make_runner(name, 16)
    prompts = [prompt(80 + n, n) for n in (50, 9, 5)]
    served = serve(runner, prompts, 48, max_new=3)  # first step: spans of 48, 9 and 5 tokens
    assert widths[0] == [48, 9]
    for ids, got in zip(prompts, served, strict=True):
        tokens, logits = hf_reference(name, tuple(ids), 3)
        assert got.tokens[: len(tokens)] == tokens
        assert max(float((a - b).abs().max()) for a, b in zip(got.logits, logits, strict=False)) < ATOL


def test_key_parts_cut_where_the_padding_saved_pays_for_a_part() -> None:
    import numpy as np

    from hybridkv.engine.forward.step import KEY_COLUMN_QUERIES, PART_COST, key_parts

    assert key_parts(np.array([5]), 1, 16) == [(0, 1)]
    assert key_parts(np.array([17, 17, 17]), 1, 16) == [(0, 3)]  # one width: one part
    assert key_parts(np.array([17, 16, 16, 15]), 1, 16) == [(0, 4)]  # close widths: not worth a part
    widths = np.array([17] * 20 + [9] * 20 + [2] * 20)  # a decode group of the bench: contexts of 12-272 tokens
    parts = key_parts(widths, 1, 16)
    assert parts == [(0, 20), (20, 40), (40, 60)]

    def cost(cuts: list[tuple[int, int]], q: int) -> float:
        return sum(PART_COST + (b - a) * (q + KEY_COLUMN_QUERIES) * 16 * int(widths[a:b].max()) for a, b in cuts)

    assert cost(parts, 1) < cost([(0, 60)], 1)
    assert key_parts(np.array([17, 16]), 64, 16) == [(0, 2)]  # a page of padding: not worth a part
    assert key_parts(np.array([17, 2]), 64, 16) == [(0, 1), (1, 2)]  # 64 queries over 15 pages of padding: it is


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gpt-oss", "tiny-kimi-linear", "tiny-qwen3-next"])
def test_rows_of_unequal_contexts_attend_in_key_parts_and_stay_exact(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With parts that cost nothing every change of key width cuts one: decodes of 9-130-token contexts (and the
    prefill groups) attend in several parts of their own widths (sliding windows, sinks, MLA latents alike), and
    every request still gets transformers' tokens and logits. The decode rows take the gathered path here (paged
    decodes take no key columns: ``ops.paged_decode``)."""
    import hybridkv.engine.forward.step as step_module
    import hybridkv.engine.runner as runner_module

    parts: list[int] = []

    def spy(*args: Any) -> StepContext:
        ctx = build_step(*args)
        parts.append(max(len(p) for io in ctx.tokens.values() for p in io.parts))
        return ctx

    build_step = runner_module.build_step
    monkeypatch.setattr(runner_module, "build_step", spy)
    monkeypatch.setattr(step_module, "PART_COST", 0)
    runner = make_runner(name, 4)
    prompts = [prompt(90 + n, n) for n in (127, 96, 40, 13, 6)]
    with fast_paths(paged_decode=False, paged_spans=False):
        served = serve(runner, prompts, 128, max_new=3)
    assert max(parts[1:]) >= 4  # the decode steps: widths of 33, 25, 11, 4 and 3 pages
    for ids, got in zip(prompts, served, strict=True):
        tokens, logits = hf_reference(name, tuple(ids), 3)
        assert got.tokens[: len(tokens)] == tokens
        assert max(float((a - b).abs().max()) for a, b in zip(got.logits, logits, strict=False)) < ATOL


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=9), fixed=st.sampled_from([0.0, 0.5, 2.0, 7.5, 40.0]))
def test_padded_parts_are_a_cheapest_cut(sizes: list[int], fixed: float) -> None:
    """Against every way to cut ``sizes`` into contiguous parts: the search's parts cover it in order and cost the
    least (each part padded to its largest, plus ``fixed``)."""
    from hybridkv.engine.forward.step import padded_parts

    def cost(parts: list[tuple[int, int]]) -> float:
        return sum(fixed + (b - a) * max(sizes[a:b]) for a, b in parts)

    parts = padded_parts(sizes, fixed)
    assert [a for a, _ in parts] == [0] + [b for _, b in parts[:-1]] and parts[-1][1] == len(sizes)
    n = len(sizes)
    cheapest = min(
        cost([(a, b) for a, b in zip([0, *cuts], [*cuts, n], strict=True)])
        for mask in range(2 ** (n - 1))
        for cuts in [[i for i in range(1, n) if mask >> (i - 1) & 1]]
    )
    assert cost(parts) <= cheapest + 1e-9
