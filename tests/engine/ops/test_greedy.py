"""The greedy choice (``ops.greedy``): the C++ kernel and the torch path give what argmax and a finite check give."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.ops.greedy import NON_FINITE, greedy
from hybridkv.engine.ops.native import native


def _reference(logits: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(logits).all(dim=-1), torch.argmax(logits, dim=-1), NON_FINITE)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_the_first_argmax_of_finite_rows(kernel: bool, dtype: torch.dtype) -> None:
    if kernel and native() is None:
        pytest.skip("no C++ compiler here: the torch path serves")
    for seed in range(4):
        logits = torch.randint(-3, 3, (12, 1000 + 37 * seed), generator=torch.Generator().manual_seed(seed)).to(dtype)
        logits[1, 5], logits[2, 700], logits[3, 0] = float("nan"), float("inf"), float("-inf")
        logits[4] = -0.0  # equal maxima of different bits: the first is argmax's
        logits[4, 600] = 0.0
        logits[5] = float("-inf")
        with fast_paths(native_kernels=kernel):
            assert torch.equal(greedy(logits), _reference(logits))
