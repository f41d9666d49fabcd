"""Token-exactness against transformers: Gemma 3, gpt-oss and Qwen3-Next served through UnifiedMemory.

Every run prefills in chunks that align with neither pages nor windows (5 and 7), then
decodes greedily; the tokens must equal ``generate(do_sample=False)`` and every
last-position logit row must be within ``ATOL`` of the HF forward on the same sequence
(measured max difference on this machine: ~6e-7, logits of magnitude ~0.1-1). Windows are
8 (Gemma 3) and 12 (gpt-oss) tokens: prompts run below, at and well above them. Memory
is verified at the end and holds nothing once the requests are freed.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.spec import FULL_POOL
from tests.engine.harness import hf_reference, live_counts, make_runner, prompt, serve

ATOL = 1e-4
MODELS = ["tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-next"]
WINDOW = {"tiny-gemma3": 8, "tiny-gpt-oss": 12, "tiny-qwen3-next": 8}


def _check(name: str, prompts: list[list[int]], served: list, max_new: int) -> None:
    for ids, got in zip(prompts, served, strict=True):
        tokens, logits = hf_reference(name, tuple(ids), max_new)
        # the runner decodes past EOS; generate stops there
        assert got.tokens[: len(tokens)] == tokens, f"{name}: prompt of {len(ids)} tokens"
        diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, logits, strict=False))
        assert diff < ATOL, f"{name}: logits differ by {diff}"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("where", ["below", "at", "above"])
def test_single_request_chunked_prefill_then_decode(name: str, page_size: int, where: str) -> None:
    window = WINDOW[name]
    length = {"below": window - 3, "at": window, "above": 4 * window + 3}[where]
    runner = make_runner(name, page_size)
    empty = live_counts(runner.mem)
    ids = prompt(length, length)
    for chunk in (5, 7):
        _check(name, [ids], serve(runner, [ids], chunk, max_new=6), 6)
        assert live_counts(runner.mem) == empty


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", MODELS)
def test_many_requests_batched_in_each_forward(name: str, page_size: int) -> None:
    runner = make_runner(name, page_size)
    empty = live_counts(runner.mem)
    lengths = [1, 4, 9, 13, 22, 41]
    prompts = [prompt(100 + n, n) for n in lengths]
    served = serve(runner, prompts, 7, max_new=5)
    _check(name, prompts, served, 5)
    assert live_counts(runner.mem) == empty


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gpt-oss"])
def test_compaction_between_steps_moves_cells_and_changes_nothing(name: str) -> None:
    """Physical ids live for one step only: cells moved between steps are found again by translation.

    (Window pages leaving the window make the holes compaction fills; Qwen3-Next, without
    windows, is compacted under retraction in ``test_engine``.)"""
    runner = make_runner(name, 1, budget=200_000, max_context=64)
    lengths = [2, 30, 5, 17, 9, 25]
    prompts = [prompt(300 + n, n) for n in lengths]
    served = serve(runner, prompts, 5, max_new=6, compact=True)
    assert runner.mem.stats().bytes_moved > 0
    _check(name, prompts, served, 6)


def test_window_pages_leave_the_window_pool_during_a_long_request() -> None:
    """A long Gemma 3 request keeps few pages in its window pool while full KV keeps them all."""
    runner = make_runner("tiny-gemma3", 4)
    mem = runner.mem
    ids = prompt(7, 60)
    from hybridkv.engine.forward.batch import ForwardBatch
    from hybridkv.engine.sched.kv import Admission, Budget, RequestKV
    from hybridkv.engine.sched.request import Request, SamplingParams

    kv = RequestKV(mem, prefix_cache=False)
    req = Request(0, list(ids), SamplingParams())
    assert kv.admit(req, Budget(7, alone=True)) is Admission.ADMITTED
    for start in range(0, 60, 7):
        chunk = ids[start : start + 7]
        prefix = req.computed
        kv.allocate([req], [len(chunk)])
        runner.forward(ForwardBatch.build([chunk], [prefix], [req.kv.token_locs()]))
        kv.computed([req])
        req.computed += len(chunk)
    pages = req.kv.token_locs()[:: mem.page_size] // mem.page_size
    window_pool = mem.window_pools[0].pool_id
    resident = mem.resident(pages, window_pool)
    assert resident.sum() <= -(-8 // 4) + 1 and not resident[0]
    assert mem.resident(pages, FULL_POOL).all()
    mem.verify()
    kv.free(req, cache=False)
    mem.verify()


def test_logits_are_not_trivially_small() -> None:
    """The tolerance means something: logits of the tiny models are far larger than ATOL."""
    for name in MODELS:
        _, logits = hf_reference(name, tuple(prompt(1, 10)), 2)
        assert float(logits.abs().max()) > 1000 * ATOL
        assert torch.isfinite(logits).all()
