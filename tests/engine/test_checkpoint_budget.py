"""A request that fits the budget alone never fails because of state checkpoints (issue 19, item 9).

At a budget just above the feasibility floor (one ``max_context`` request fits, nothing more),
checkpoints every few pages (``interval:N``, or the engine's default placement, a checkpoint
every chunk) used to hold the slab bytes the request's own KV needed: the cache never dropped a
checkpoint for bytes, and the running request's lock held its last checkpoint, so the request
failed "does not fit ... even alone". Now cached checkpoints are evicted for slab bytes, a
running request's lock does not hold a checkpoint, and a request's own checkpoints not
inserted yet are given up before its pages are refused. Every run stays token-exact, and the
memory and the cache tree hold after each request.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.registry import engine_spec
from hybridkv.memory import LayoutError
from hybridkv.memory.sizing import MemoryHints, plan_memory
from hybridkv.spec import ShardSpec
from tests.engine.harness import hf_model, hf_reference, live_counts, prompt

PAGE = 16
CONTEXT = 128
CHUNK = 32
NEW = 6


def floor_budget(name: str) -> int:
    """The smallest budget (to 64 bytes) that sizing accepts for one ``CONTEXT``-token request."""
    shard = ShardSpec.whole(engine_spec(hf_model(name).config, torch.float32, name=name))
    hints = MemoryHints(page_size=PAGE, max_context=CONTEXT, chunk_tokens=CHUNK)
    lo, hi = 1, 1 << 26
    while hi - lo > 64:
        mid = (lo + hi) // 2
        try:
            plan_memory(shard, mid, hints)
            hi = mid
        except LayoutError:
            lo = mid
    return hi


@pytest.mark.parametrize("placement", ["interval:16", None, "interval:32,branch,end"])
@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear", "tiny-nemotron-h"])
def test_a_request_that_fits_alone_never_fails_for_its_checkpoints(name: str, placement: str | None) -> None:
    hf = hf_model(name)
    engine = Engine(
        hf.config,
        hf,
        EngineConfig(
            gpu_memory=floor_budget(name), page_size=PAGE, chunk_size=CHUNK, max_context=CONTEXT, checkpoints=placement
        ),
    )
    empty = live_counts(engine.mem)
    first = prompt(77, CONTEXT - NEW)
    later = first[:70] + prompt(78, CONTEXT - NEW - 70)  # shares 70 tokens: hits a checkpoint there
    for ids in (first, later, first):
        [out] = engine.generate([ids], NEW)
        assert out.error is None, out.error
        assert out.output_ids == hf_reference(name, tuple(ids), NEW)[0]
        engine.mem.verify()
        engine.cache.check()
    assert engine.cache.stats()["states"] or engine.cache.stats()["evicted_states"]
    # several at once, each fitting alone: retracted and resumed, never failed
    outs = engine.generate([first, later, prompt(79, 60)], NEW)
    for ids, out in zip([first, later, prompt(79, 60)], outs, strict=True):
        assert out.error is None, out.error
        assert out.output_ids == hf_reference(name, tuple(ids), NEW)[0]
    engine.clear_cache()
    engine.mem.verify()
    engine.cache.check()
    assert live_counts(engine.mem) == empty
