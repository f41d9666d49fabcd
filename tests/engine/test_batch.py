"""ForwardBatch refuses parts that do not fit together; the runner refuses a stateful step without slots."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.engine.batch import BatchError, ForwardBatch
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
    locs = runner.mem.alloc(3)
    with pytest.raises(BatchError, match="give every request a state slot"):
        runner.forward(ForwardBatch.build([[1, 2, 3]], [0], [locs]))
    runner.mem.free(locs)
