"""``check_request``: what a prompt must be before it reaches the scheduler (the engine's edge)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hybridkv.engine.sched.request import RequestError, SamplingParams, check_request

VOCAB, CONTEXT = 256, 64
PARAMS = SamplingParams(max_new_tokens=4)


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([1, True], "flat list of integer token ids, got [True]"),
        ([1, 2.0], "flat list of integer token ids, got [2.0]"),
        ([[1, 2]], "flat list of integer token ids"),
        (np.array([1.0]), "got an array (1,) float64"),
        (np.array([[1, 2]]), "got an array (1, 2) int64"),
        (np.array([1, True], dtype=object), "flat list of integer token ids, got [True]"),
        (np.array(5, dtype=object), "got an array () object"),  # 0-d: refused by its shape, never iterated
        (np.empty((0, 2), dtype=object), "got an array (0, 2) object"),
        (bytearray(b"\x01\x02"), "must be a list of token ids, got bytearray"),  # bytes-like, as bytes and str
        ("abc", "must be a list of token ids, got str"),
        ([], "empty prompt"),
        (np.array([], dtype=np.int64), "empty prompt"),
        ([5, 256, 7], "token ids [256] outside the vocabulary [0, 256)"),
        ([-1, 3], "token ids [-1] outside the vocabulary"),
        ([2**70], f"token ids [{2**70}] outside the vocabulary"),  # beyond int64
        (np.array([2**64 - 1], dtype=np.uint64), f"token ids [{2**64 - 1}] outside the vocabulary"),  # wraps in int64
        ([1] * (CONTEXT - 3), "exceeds the context of 64 tokens"),
    ],
)
def test_a_bad_prompt_is_refused_naming_what_is_wrong(prompt: Any, says: str) -> None:
    with pytest.raises(RequestError) as bad:
        check_request(prompt, PARAMS, VOCAB, CONTEXT)
    assert says in str(bad.value)
    assert bad.value.field == ("max_new_tokens" if "context" in says else "input_ids")


@pytest.mark.parametrize(
    "prompt",
    [
        [0, 255, 7],
        (3, np.int64(4)),
        np.array([3, 4], dtype=np.uint8),
        np.array([9], dtype=np.int32),
        np.array([1, 2], dtype=object),
    ],
)
def test_a_good_prompt_comes_back_as_plain_ints(prompt: Any) -> None:
    ids = check_request(prompt, PARAMS, VOCAB, CONTEXT).ids
    assert ids == [int(t) for t in prompt] and all(type(t) is int for t in ids)
