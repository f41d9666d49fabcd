"""ForwardBatch refuses parts that do not fit together; the runner refuses a stateful step without slots."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.engine.forward.batch import BatchError, ForwardBatch
from hybridkv.memory import TokenAllocator
from tests.engine.harness import make_runner


def _locs(n: int) -> np.ndarray:
    return np.arange(16, 16 + n, dtype=np.int64)


def test_positions_continue_each_prefix() -> None:
    batch = ForwardBatch.build([[5, 6, 7], [8]], [0, 4], [_locs(3), _locs(5)])
    assert batch.positions.tolist() == [0, 1, 2, 4]
    assert batch.seq_lens.tolist() == [3, 5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(input_ids=[[1, 2]], prefix_lens=[0], token_locs=[_locs(3)]), "request 0: 3 token locations"),
        (
            dict(input_ids=[[1], []], prefix_lens=[0, 1], token_locs=[_locs(1), _locs(1)]),
            "needs >= 1 new token",
        ),
        (dict(input_ids=[[1]], prefix_lens=[0, 0], token_locs=[_locs(1)]), "give one of each per request"),
        (dict(input_ids=[[1]], prefix_lens=[0], token_locs=[_locs(1)], state_slots=[1]), "together"),
        (
            dict(input_ids=[[1]], prefix_lens=[0], token_locs=[_locs(1)], state_slots=[1, 2], fresh_state=[1, 1]),
            "state_slots has 2 entries for 1 requests",
        ),
        (dict(input_ids=[], prefix_lens=[], token_locs=[]), "at least one request"),
    ],
)
def test_mismatched_parts_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(BatchError, match=message):
        ForwardBatch.build(**kwargs)


def test_a_model_with_recurrent_layers_needs_state_slots() -> None:
    runner = make_runner("tiny-qwen3-next", 4)
    locs = TokenAllocator(runner.mem).alloc(3)
    with pytest.raises(BatchError, match="give every request a state slot"):
        runner.forward(ForwardBatch.build([[1, 2, 3]], [0], [locs]))
    TokenAllocator(runner.mem).free(locs)


def test_page_rows_give_the_same_step_as_token_locations() -> None:
    """``from_pages`` (a scheduler's page rows) and ``build`` (per-token locations) describe the same step."""
    import torch

    from hybridkv.engine.sched.kv import Admission, Budget, RequestKV
    from hybridkv.engine.sched.request import Request, SamplingParams

    runner = make_runner("tiny-qwen3-next", 4)
    kv = RequestKV(runner.mem, prefix_cache=False)
    prompts = [list(range(3, 12)), list(range(20, 26))]
    reqs = [Request(0, ids, SamplingParams()) for ids in prompts]
    for req in reqs:
        assert kv.admit(req, Budget(16, alone=True)) is Admission.ADMITTED
    kv.allocate(reqs, [len(p) for p in prompts])
    slots, fresh = [r.kv.state_slot for r in reqs], [r.fresh for r in reqs]
    by_locs = ForwardBatch.build(prompts, [0, 0], [r.kv.token_locs() for r in reqs], slots, fresh)
    pages = [r.kv.pages for r in reqs]
    by_pages = ForwardBatch.from_pages(prompts, [0, 0], pages, runner.mem.page_size, slots, fresh)
    first = runner.forward(by_locs)
    again = runner.forward(by_pages)  # the same state slots, still fresh: the same computation
    assert torch.equal(first, again)
    for r in reqs:
        kv.free(r, cache=False)
    runner.mem.verify()


def test_page_rows_that_cannot_hold_the_context_are_refused() -> None:
    with pytest.raises(BatchError, match="request 0: 1 pages of 4 tokens cannot hold a context of 6"):
        ForwardBatch.from_pages([[1, 2]], [4], [np.array([3])], 4)
    with pytest.raises(BatchError, match="one of the two"):
        ForwardBatch(np.array([1]), np.array([0]), np.array([1]), None)
    batch = ForwardBatch.from_pages([[1, 2]], [0], [np.array([3])], 4)
    with pytest.raises(BatchError, match="page rows of 4 tokens a page for a memory of 16"):
        batch.page_table(16)
    with pytest.raises(BatchError, match="checkpoint_slots has 2 entries for 1 requests"):
        ForwardBatch.from_pages([[1, 2]], [0], [np.array([3])], 4, [5], [True], [6, 7])
    with pytest.raises(BatchError, match="give state_slots too"):
        ForwardBatch.from_pages([[1, 2]], [0], [np.array([3])], 4, checkpoint_slots=[6])
