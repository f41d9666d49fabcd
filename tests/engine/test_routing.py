"""Routed experts: each token through its chosen experts only, equal to the per-expert loop of the reference."""

from __future__ import annotations

import torch

from hybridkv.engine.layers.routing import Routing
from hybridkv.host_sync import HostSyncCounter


def _reference(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' loop: for every expert hit, its tokens' rows times its weight, weighted, added per token."""
    out = torch.zeros(x.shape[0], w.shape[2])
    for e in range(w.shape[0]):
        token, pos = torch.where(index == e)
        out.index_add_(0, token, (x[token] @ w[e]) * weights[token, pos, None])
    return out


def test_routed_matmul_equals_the_per_expert_loop() -> None:
    g = torch.Generator().manual_seed(0)
    tokens, hidden, out_dim, experts, k = 37, 16, 8, 6, 2
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(experts, hidden, out_dim, generator=g)
    index = torch.stack([torch.randperm(experts - 2, generator=g)[:k] for _ in range(tokens)])  # experts 4, 5 unused
    weights = torch.rand(tokens, k, generator=g)
    with HostSyncCounter() as counter:
        route = Routing.of(index, weights, experts)
        got = route.combine(route.matmul(route.gather(x), w), tokens)
    assert counter.total == 0  # no host read: the runs' ends come from the device
    assert route.ends.tolist()[-2:] == [tokens * k, tokens * k]  # empty runs cost nothing
    torch.testing.assert_close(got, _reference(x, index, weights, w), rtol=1e-5, atol=1e-5)


def test_a_bias_is_added_per_expert() -> None:
    x = torch.ones(3, 2)
    w = torch.zeros(2, 2, 1)
    bias = torch.tensor([[1.0], [10.0]])
    route = Routing.of(torch.tensor([[1], [0], [1]]), torch.ones(3, 1), 2)
    assert route.combine(route.matmul(route.gather(x), w, bias), 3).flatten().tolist() == [10.0, 1.0, 10.0]
