"""Engine: continuous batching, chunked prefill and retraction stay token-exact against transformers.

References are ``generate(do_sample=False)`` (stopping at EOS, as the engine does). Budgets
are chosen so that 18 requests cannot all fit: retraction must happen and the retracted
requests, recomputed later, must still produce the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.forward import pool_io
from hybridkv.engine.forward.pool_io import TokenIO, pool_layouts
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.ops.native import native
from hybridkv.engine.ops.ssd import _tril_masks
from hybridkv.engine.sched.agreement import ALONE, Agreement
from hybridkv.engine.sched.kv import Budget, RequestKV, StepRows
from hybridkv.engine.sched.request import Outcome, Request, SamplingParams
from hybridkv.memory import LayoutError, OutOfMemory
from tests.devices import device, no_host_sync, sampling_may_sync
from tests.engine.harness import hf_model, hf_reference, live_counts, prompt

MODELS = ["tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-next"]
ALL_MODELS = [*MODELS, "tiny-nemotron-h", "tiny-kimi-linear"]
PROMPTS = [prompt(200 + i, 3 + 4 * i) for i in range(18)]


def _engine(name: str, budget: int, page_size: int, device: str = "cpu") -> Engine:
    hf = hf_model(name)
    return Engine(
        hf.config, hf, EngineConfig(gpu_memory=budget, page_size=page_size, chunk_size=7, max_context=96, device=device)
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_many_requests_under_a_small_budget_retract_and_stay_exact(name: str, page_size: int) -> None:
    engine = _engine(name, 150_000, page_size)
    empty = live_counts(engine.mem)
    outs = engine.generate(PROMPTS, 8)
    assert engine.stats["retractions"] > 0
    assert any(o.retractions for o in outs)
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out.error is None
        assert out.output_ids == hf_reference(name, tuple(ids), 8)[0], f"prompt of {len(ids)} tokens"
    engine.mem.verify()
    engine.cache.check()
    engine.clear_cache()
    assert live_counts(engine.mem) == empty


def test_compaction_under_retraction_stays_exact() -> None:
    """Retraction frees memory in the middle of others' rows; the memory compacts to make room."""
    engine = _engine("tiny-qwen3-next", 150_000, 1)
    outs = engine.generate(PROMPTS, 8)
    assert engine.mem.stats().bytes_moved > 0
    assert [o.output_ids for o in outs] == [hf_reference("tiny-qwen3-next", tuple(p), 8)[0] for p in PROMPTS]


def test_a_large_budget_needs_no_retraction() -> None:
    engine = _engine("tiny-gpt-oss", 2_000_000, 16)
    outs = engine.generate(PROMPTS, 8)
    assert engine.stats["retractions"] == 0
    assert [o.output_ids for o in outs] == [hf_reference("tiny-gpt-oss", tuple(p), 8)[0] for p in PROMPTS]


def test_bad_requests_fail_alone_and_the_others_stay_exact() -> None:
    engine = _engine("tiny-gemma3", 400_000, 4)
    good = PROMPTS[:3]
    ended: list[tuple[int, Outcome]] = []
    outs = engine.generate(
        [good[0], [], good[1], [5, 256, 7], [3] * 95, good[2]], 6, on_output=lambda i, o: ended.append((i, o))
    )
    assert sorted(i for i, _ in ended) == list(range(6))  # once per request, failed ones included
    assert all(out is outs[i] for i, out in ended)
    assert [o.finish_reason == "error" for o in outs] == [False, True, False, True, True, False]
    assert "empty prompt" in (outs[1].error or "")
    assert "outside the vocabulary [0, 256)" in (outs[3].error or "")
    assert "exceeds the context of 96 tokens" in (outs[4].error or "")
    for i, ids in zip([0, 2, 5], good, strict=True):
        assert outs[i].output_ids == hf_reference("tiny-gemma3", tuple(ids), 6)[0]


def test_on_token_streams_each_requests_tokens_once_in_order_through_retraction() -> None:
    engine = _engine("tiny-qwen3-next", 150_000, 4)
    streamed: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    ended: set[int] = set()

    def token(i: int, t: int) -> None:
        assert i not in ended, f"request {i}: a token after its output"
        streamed[i].append(t)

    outs = engine.generate(PROMPTS, 8, on_token=token, on_output=lambda i, o: ended.add(i))
    assert engine.stats["retractions"] > 0
    assert [streamed[i] for i in range(len(PROMPTS))] == [o.output_ids for o in outs]


def test_a_budget_below_one_request_is_refused_at_start() -> None:
    with pytest.raises(LayoutError, match="one request of 96 tokens needs"):
        _engine("tiny-gemma3", 60_000, 16)


def test_seeded_sampling_is_independent_of_batching_and_retraction() -> None:
    small, large = _engine("tiny-qwen3-next", 150_000, 4), _engine("tiny-qwen3-next", 2_000_000, 4)
    a = small.generate(PROMPTS, 8, temperature=1.0, seed=7)
    b = large.generate(PROMPTS, 8, temperature=1.0, seed=7)
    alone = large.generate(PROMPTS[5:6], 8, temperature=1.0, seed=12)  # request 5 of the batch had seed 7 + 5
    assert small.stats["retractions"] > 0
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    assert alone[0].output_ids == a[5].output_ids
    c = large.generate(PROMPTS, 8, temperature=1.0, seed=8)
    assert [o.output_ids for o in c] != [o.output_ids for o in b]
    greedy = [hf_reference("tiny-qwen3-next", tuple(p), 8)[0] for p in PROMPTS]
    assert [o.output_ids for o in b] != greedy


def test_generation_stops_at_eos() -> None:
    engine = _engine("tiny-gemma3", 400_000, 4)
    outs = engine.generate(PROMPTS, 8)
    reasons = {o.finish_reason for o in outs}
    assert "eos" in reasons  # prompt 11 of this seed list ends on EOS (id 1) within 8 tokens
    for out in outs:
        assert (out.finish_reason == "eos") == (out.output_ids[-1:] == [1])


@pytest.mark.host_sync
@pytest.mark.parametrize("name", ALL_MODELS)
def test_the_only_host_read_is_the_sampled_tokens(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory calls, id translation and every layer's forward read nothing back from the device;
    choosing the next tokens reads them once per step (one ``tolist``)."""
    engine = _engine(name, 150_000, 4, device())
    sampling_may_sync(monkeypatch)
    with no_host_sync() as counter:
        engine.generate(PROMPTS, 8)
    assert engine.stats["retractions"] > 0
    assert set(counter.counts) == {"tolist"}
    assert counter.counts["tolist"] <= engine.stats["steps"]


def test_engine_from_a_save_pretrained_directory(tmp_path: Path) -> None:
    hf_model("tiny-gpt-oss").save_pretrained(tmp_path)
    engine = Engine(tmp_path, config=EngineConfig(gpu_memory=400_000, page_size=4, chunk_size=5, max_context=96))
    outs = engine.generate(PROMPTS[:4], 6)
    assert [o.output_ids for o in outs] == [hf_reference("tiny-gpt-oss", tuple(p), 6)[0] for p in PROMPTS[:4]]


def test_a_spec_alone_is_refused_with_what_to_pass() -> None:
    hf = hf_model("tiny-gemma3")
    engine = _engine("tiny-gemma3", 400_000, 4)
    with pytest.raises(TypeError, match="pass a ModelSpec as spec="):
        Engine(engine.spec, hf)


def test_admission_counts_state_slots_not_only_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nemotron-H's state (31 KB a request) binds before its KV pages do: a request is admitted only
    when its state slot fits, so every step the allocator refuses is a real retraction (the code that
    looked at free pages alone admitted requests whose slot could not be taken: 31 refusals, 3 retractions)."""
    refused = []
    allocate = RequestKV.allocate

    def counting(self: RequestKV, reqs: list[Request], spans: list[int], agree: Agreement = ALONE) -> StepRows:
        try:
            return allocate(self, reqs, spans, agree)
        except OutOfMemory:
            refused.append(len(reqs))
            raise

    monkeypatch.setattr(RequestKV, "allocate", counting)
    engine = Engine(
        hf_model("tiny-nemotron-h").config,
        hf_model("tiny-nemotron-h"),
        EngineConfig(gpu_memory=250_000, page_size=16, chunk_size=7, max_context=96),
    )
    empty = live_counts(engine.mem)
    outs = engine.generate(PROMPTS, 8)
    assert engine.stats["retractions"] > 0
    assert len(refused) == engine.stats["retractions"]
    assert [o.output_ids for o in outs] == [hf_reference("tiny-nemotron-h", tuple(p), 8)[0] for p in PROMPTS]
    engine.clear_cache()
    assert live_counts(engine.mem) == empty


def test_the_kv_facades_batched_calls_refuse_a_request_without_memory() -> None:
    """``pages_needed``, ``allocate``, ``computed`` and ``free(cache=True)`` take many requests in one call; one
    that holds no memory (never admitted, or retracted) is refused by name, and nothing is allocated."""
    engine = Engine(
        hf_model("tiny-gemma3").config, hf_model("tiny-gemma3"), EngineConfig(gpu_memory="4MiB", max_context=96)
    )
    kv = engine.kv
    ids = prompt(5, 20)
    admitted, waiting = Request(0, ids, SamplingParams()), Request(1, ids, SamplingParams())
    kv.admit(admitted, Budget(64, alone=True))
    before = live_counts(engine.mem)
    for call in (
        lambda: kv.pages_needed([admitted, waiting], [20, 20]),
        lambda: kv.allocate([admitted, waiting], [20, 20]),
        lambda: kv.computed([admitted, waiting]),
        lambda: kv.free(admitted, waiting, cache=True),
    ):
        with pytest.raises(RuntimeError, match="holds no memory: admit it first"):
            call()
    assert live_counts(engine.mem) == before
    assert kv.pages_needed([admitted], [20]) == 2  # 20 tokens, 16 a page
    rows = kv.allocate([admitted], [20])
    assert rows.pages[0].size == 2 and rows.slots is None and rows.fresh is None
    kv.free(admitted, cache=False)
    engine.mem.verify()


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-nemotron-h"])
def test_steps_run_in_inference_mode_and_what_outlives_a_step_is_a_normal_tensor(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(name, 400_000, 4)
    model = engine.runner.model
    modes: list[bool] = []
    forward = type(model).forward

    def spy(self: CausalLM, *args: Any, **kwargs: Any) -> torch.Tensor:
        modes.append(torch.is_inference_mode_enabled())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    outs = engine.generate(PROMPTS[:3], 4)
    assert modes and all(modes)
    assert [o.output_ids for o in outs] == [hf_reference(name, tuple(p), 4)[0] for p in PROMPTS[:3]]
    kept = [t for layout in pool_layouts(engine.mem).tokens.values() for t in layout._workspace]
    derived = [v[1] for m in model.modules() for v in vars(m).values() if isinstance(v, tuple) and len(v) == 2]
    kept += [t for t in derived if isinstance(t, torch.Tensor)]
    if name == "tiny-nemotron-h":  # its chunked scan's cached masks
        kept += _tril_masks(int(engine.config.chunk_size), torch.device("cpu"))
    else:  # Gemma 3's (1 + w) norm factors
        assert len(derived) >= 4 * int(engine.config.num_hidden_layers)
    assert kept and not any(t.is_inference() for t in kept)
    norm = model.norm  # the modules still run with autograd outside the runner
    x = torch.randn(2, int(engine.config.hidden_size), requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3-next"])
def test_prompts_read_their_keys_from_the_pages(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 prompts chunked over several steps (a chunk on the keys of earlier ones) and decodes read every key from
    the pool's pages (``ops.paged_spans``, ``ops.paged_decode``): nothing is gathered, and the tokens are
    ``transformers``' (the gathered path's check: the windowed-gather test above)."""
    if native() is None:
        pytest.skip("no C++ compiler here: prompts take the gathered path")
    engine = _engine(name, 400_000, 4)
    gathered: list[int] = []
    gather = TokenIO.gather

    def spy(layout: Any, cells: torch.Tensor, zero_cols: torch.Tensor, slots: slice, out: Any = None) -> torch.Tensor:
        gathered.append(cells.numel())
        return gather(layout, cells, zero_cols, slots, out)

    monkeypatch.setattr(TokenIO, "gather", staticmethod(spy))
    outs = engine.generate(PROMPTS[:6], 5)
    assert [o.output_ids for o in outs] == [hf_reference(name, tuple(p), 5)[0] for p in PROMPTS[:6]]
    assert not gathered
    with fast_paths(paged_spans=False):  # the switch works: the prompts' keys are gathered again
        engine.generate(PROMPTS[6:8], 2)
    assert gathered
    engine.mem.verify()


@pytest.mark.parametrize("name", [*MODELS, "tiny-kimi-linear"])  # tiny Nemotron-H has one attention layer
def test_keys_beyond_the_workspace_are_gathered_a_window_of_layers_at_a_time(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_io, "WORKSPACE_SHARE", 0.0)  # no room: every gather holds one layer's slots
    engine = _engine(name, 400_000, 4)
    windows: list[tuple[int, int]] = []
    gather = TokenIO.gather

    def spy(layout: Any, cells: torch.Tensor, zero_cols: torch.Tensor, slots: slice, out: Any = None) -> torch.Tensor:
        windows.append((slots.stop - slots.start, layout.slots))
        return gather(layout, cells, zero_cols, slots, out)

    monkeypatch.setattr(TokenIO, "gather", staticmethod(spy))
    with fast_paths(paged_spans=False):  # the prompts' keys gathered (read from the pages, nothing is)
        outs = engine.generate(PROMPTS[:4], 5)
    assert [o.output_ids for o in outs] == [hf_reference(name, tuple(p), 5)[0] for p in PROMPTS[:4]]
    layer_slots = 1 if name == "tiny-kimi-linear" else 2  # an MLA latent, or K and V
    assert windows and all(count == layer_slots for count, _ in windows)
    assert any(slots > layer_slots for _, slots in windows)  # a pool of several layers was gathered in windows
    for layout in pool_layouts(engine.mem).tokens.values():
        assert layout.workspace_bytes == 0 and layout.window(10**6) == layer_slots
    engine.mem.verify()
