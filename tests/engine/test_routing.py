"""Routed experts: each token through its chosen experts only, equal to the per-expert loop of the reference."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.layers.linear import PackedExperts, packs
from hybridkv.engine.layers.routing import ROW_BUCKET, Routing
from hybridkv.host_sync import HostSyncCounter


def _reference(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' loop: for every expert hit, its tokens' rows times its weight, weighted, added per token."""
    out = torch.zeros(x.shape[0], w.shape[2])
    for e in range(w.shape[0]):
        token, pos = torch.where(index == e)
        out.index_add_(0, token, (x[token] @ w[e]) * weights[token, pos, None])
    return out


def _packed(plain: torch.Tensor) -> PackedExperts:
    """Experts ``(E, out, in)`` (any layout) with each one's weight packed for oneDNN."""
    return PackedExperts(plain, [torch.ops.mkldnn._reorder_linear_weight(e.contiguous()) for e in plain])


def _count_packed_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every packed oneDNN call from now on (a spy on ``_linear_pointwise``)."""
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return calls


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


@pytest.mark.skipif(
    not packs(torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16)),
    reason="oneDNN bf16 (the packed path) not on this CPU",
)
@pytest.mark.parametrize("tokens", [37, 64, 200, 300])
def test_packed_runs_widened_to_row_buckets_equal_the_exact_runs_within_bf16_rounding(
    tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each expert's run of more than ``ROW_BUCKET`` rows computed on a multiple of it (the next runs' rows, or zeros
    after the last one) gives its own rows' products: the rows read past a run are dropped, none leaks into another
    expert's; shorter runs keep their length."""
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, out_dim, k = 5, 64, 48, 2
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w = torch.randn(experts, hidden, out_dim, generator=g).bfloat16()
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    route = Routing.of(index, torch.rand(tokens, k, generator=g).bfloat16(), experts)
    rows = route.gather(x)
    packed = _packed(w.transpose(1, 2))
    calls = _count_packed_calls(monkeypatch)
    with fast_paths(row_buckets=False):
        exact = route.matmul(rows, w, packed=packed)
    exact_calls, calls[:] = list(calls), []
    widened = route.matmul(rows, w, packed=packed)
    assert len(calls) == len(exact_calls) == experts
    assert all(w % ROW_BUCKET == 0 if n > ROW_BUCKET else w == n for w, n in zip(calls, exact_calls, strict=True))
    assert widened.shape == exact.shape == (tokens * k, out_dim)
    want = torch.bmm(rows.float().unsqueeze(1), w.float()[route.expert]).squeeze(1)
    scale = want.abs().max()
    assert (widened.float() - exact.float()).abs().max() <= scale * 2**-7
    assert (widened.float() - want).abs().max() <= scale * 2**-7


@pytest.mark.skipif(
    not packs(torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16)),
    reason="oneDNN bf16 (the packed path) not on this CPU",
)
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_a_decodes_short_runs_take_the_skinny_kernel_where_expert_rows_are_contiguous(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of one or two rows goes through the skinny kernel when the plain weight's rows are contiguous (out, in)
    and through oneDNN's packed weight otherwise (in, out stored: gpt-oss); both within bf16 rounding of the exact
    products."""
    from hybridkv.engine.ops.native import native

    if native() is None:
        pytest.skip("no C++ compiler here")
    g = torch.Generator().manual_seed(5)
    experts, hidden, out_dim = 4, 96, 40
    stored = torch.randn(experts, out_dim, hidden, generator=g).bfloat16()
    plain = stored if layout == "out_in" else stored.transpose(1, 2).contiguous().transpose(1, 2)
    x = torch.randn(2, hidden, generator=g).bfloat16()
    route = Routing.of(torch.tensor([[0, 3], [3, 1]]), torch.full((2, 2), 0.5).bfloat16(), experts)  # runs 1, 1, 2
    rows = route.gather(x)
    packed = _packed(plain)
    calls = _count_packed_calls(monkeypatch)
    got = route.matmul(rows, plain.transpose(1, 2), packed=packed)
    assert calls == ([] if layout == "out_in" else [1, 1, 2])
    want = torch.bmm(rows.float().unsqueeze(1), plain.float().transpose(1, 2)[route.expert]).squeeze(1)
    assert (got.float() - want).abs().max() <= want.abs().max() * 2**-7


@pytest.mark.skipif(
    not packs(torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16)),
    reason="oneDNN bf16 (the packed path) not on this CPU",
)
@pytest.mark.parametrize("tokens", [3, 100])
def test_packed_mlp_expert_by_expert_equals_the_combined_path_within_bf16_rounding(tokens: int) -> None:
    """``packed_mlp``: every expert's run through both projections and its weights, added into its tokens' rows,
    equals ``combine(matmul(inner(matmul(...))))`` within bf16 rounding (the weights scale the inner activations);
    an expert no token chose adds nothing."""
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inner_size, k = 5, 64, 40, 2
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    first = (torch.randn(experts, 2 * inner_size, hidden, generator=g) / 8).bfloat16()  # (E, out, in)
    second = (torch.randn(experts, hidden, inner_size, generator=g) / 6).bfloat16()
    index = torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(tokens)])  # expert 4: none
    weights = torch.rand(tokens, k, generator=g).bfloat16()
    route = Routing.of(index, weights, experts)
    rows = route.gather(x)
    torch.testing.assert_close(rows, x[route.token], rtol=0, atol=0)

    def inner(both: torch.Tensor) -> torch.Tensor:
        gate, up = both.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    got = route.packed_mlp(rows, _packed(first), _packed(second), inner, tokens)
    combined = route.combine(
        route.matmul(inner(route.matmul(rows, first.transpose(1, 2))), second.transpose(1, 2)), tokens
    )
    exact = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            e, w = int(index[t, j]), float(weights[t, j])
            exact[t] += w * (second[e].double() @ inner(first[e].double() @ x[t].double()))
    scale = float(exact.abs().max())
    assert got.shape == combined.shape == (tokens, hidden)
    assert float((got.double() - exact).abs().max()) <= scale * 2**-6
    assert float((got.double() - combined.double()).abs().max()) <= scale * 2**-6
