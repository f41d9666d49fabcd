"""The chunked gated delta rule of bf16 inputs in one C++ call (``ops.delta_chunks``): within bf16's rounding of the
exact rule (the torch path in fp64), each row of a ragged batch computed as if alone, a split sequence equal to one
pass within rounding, steep decays flushed, and every malformed argument refused naming what it got."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.ops import gated_delta
from hybridkv.engine.ops.delta_chunks import delta_chunks, delta_chunks_take
from hybridkv.engine.ops.gated_delta import FLUSH, gated_delta_prefill
from hybridkv.engine.ops.native import native

from .chunking import spans


def _kernels() -> None:
    kernels = native()
    if kernels is None or not kernels.delta_chunks_ready():
        pytest.skip("no C++ compiler, or neither bf16 brgemm nor AVX-512 BF16 here: the torch path serves")


def _inputs(
    batch: int, seq: int, heads: tuple[int, int], dims: tuple[int, int], seed: int, steep: float = 1.0
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    (heads_k, heads_v), (dk, dv) = heads, dims
    return {
        "q": torch.randn(batch, seq, heads_k, dk, generator=g).bfloat16(),
        "k": torch.randn(batch, seq, heads_k, dk, generator=g).bfloat16(),
        "v": torch.randn(batch, seq, heads_v, dv, generator=g).bfloat16(),
        "g": -F.softplus(torch.randn(batch, seq, heads_v, generator=g)) * steep,
        "beta": torch.sigmoid(torch.randn(batch, seq, heads_v, generator=g)),
        "state": torch.randn(batch, heads_v, dk, dv, generator=g),
    }


def _exact(inputs: dict[str, torch.Tensor], lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path in fp64 on the same (bf16-valued) inputs: transformers' arithmetic, no rounding to speak of."""
    return gated_delta_prefill(**{name: x.double() for name, x in inputs.items()}, lengths=lengths, chunk_size=64)


def _assert_within_bf16(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Measured on these inputs: max error <= 0.7% of the largest value, RMS error ~0.4% of the RMS value (bf16's
    2**-8 on each product's operands); the bounds leave 4x, a wrong decay, gate or head is off by tens of percent."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = got.double() - want
    worst = float(err.abs().max() / want.abs().max())
    rms = float(err.pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    assert worst <= 2**-5 and rms <= 2**-6, f"{what}: max error {worst:.4f} of the largest, RMS {rms:.4f} of the RMS"


@pytest.mark.parametrize(
    ("seq", "heads", "dims"),
    [
        (1, (2, 4), (16, 8)),
        (5, (2, 4), (16, 8)),
        (64, (2, 4), (16, 8)),
        (150, (2, 4), (16, 8)),
        (150, (2, 4), (128, 128)),
        (97, (1, 2), (64, 32)),
    ],
)
@pytest.mark.parametrize("steep", [1.0, 20.0], ids=["decays", "steep-decays"])
def test_outputs_and_state_are_the_exact_rule_within_bf16_rounding(
    seq: int, heads: tuple[int, int], dims: tuple[int, int], steep: float
) -> None:
    _kernels()
    inputs = _inputs(3, seq, heads, dims, seed=seq, steep=steep)
    out, final = delta_chunks(**inputs, lengths=None, flush=FLUSH)
    want_out, want_final = _exact(inputs)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    _assert_within_bf16(out, want_out, "output")
    _assert_within_bf16(final, want_final, "final state")
    assert not ((final != 0) & (final.abs() < torch.finfo(torch.float32).tiny)).any(), "denormal state entries"


def test_each_row_of_a_ragged_batch_is_computed_as_if_alone() -> None:
    _kernels()
    lengths = torch.tensor([1, 70, 5, 0, 64])
    inputs = _inputs(5, 70, (2, 4), (16, 8), seed=3)
    out, final = delta_chunks(**inputs, lengths=lengths, flush=FLUSH)
    for row, n in enumerate(lengths.tolist()):
        alone = {name: inputs[name][row : row + 1, :n] for name in ("q", "k", "v", "g", "beta")}
        alone["state"] = inputs["state"][row : row + 1]
        alone_out, alone_final = delta_chunks(**alone, lengths=None, flush=FLUSH)
        assert torch.equal(out[row, :n], alone_out[0]), f"row {row} output"
        assert torch.equal(final[row], alone_final[0]), f"row {row} final state"
        assert not out[row, n:].any(), f"row {row}: positions past its length are zero"
    assert torch.equal(final[3], inputs["state"][3])  # an empty row keeps its state exactly


def test_a_sequence_split_into_calls_equals_one_pass_within_rounding() -> None:
    _kernels()
    inputs = _inputs(2, 170, (2, 4), (32, 16), seed=21)
    whole, whole_final = delta_chunks(**inputs, lengths=None, flush=FLUSH)
    state, pieces = inputs["state"], []
    for start, end in spans(170):
        part = {name: x[:, start:end] for name, x in inputs.items() if name != "state"}
        out, state = delta_chunks(**part, state=state, lengths=None, flush=FLUSH)
        pieces.append(out)
    want_out, want_final = _exact(inputs)
    _assert_within_bf16(torch.cat(pieces, dim=1), want_out, "split output")
    _assert_within_bf16(state, want_final, "split final state")
    _assert_within_bf16(whole, want_out, "one-pass output")
    _assert_within_bf16(whole_final, want_final, "one-pass final state")


def test_gated_delta_prefill_takes_the_kernel_for_bf16_inputs_only() -> None:
    _kernels()
    inputs = _inputs(2, 40, (2, 4), (16, 8), seed=5)
    lengths = torch.tensor([40, 17])
    q, k, v, g, beta, state = (inputs[n] for n in ("q", "k", "v", "g", "beta", "state"))
    assert delta_chunks_take(q, k, v, g, beta, state)
    assert not delta_chunks_take(q.float(), k.float(), v.float(), g, beta, state)
    assert not delta_chunks_take(q[..., :15], k[..., :15], v, g, beta, state)  # an odd key dimension
    assert not delta_chunks_take(q[..., :0], k[..., :0], v, g, beta, state)  # no key dimension: the torch path's
    learned = g.clone().requires_grad_(True)  # a gradient through the decays: the kernel records none
    assert not delta_chunks_take(q, k, v, learned, beta, state)
    with torch.no_grad():
        assert delta_chunks_take(q, k, v, learned, beta, state)
    with pytest.MonkeyPatch.context() as patch:  # oneDNN off: ATen's brgemm refuses bf16, the torch path serves
        patch.setattr(torch.backends.mkldnn, "enabled", False)
        assert not delta_chunks_take(q, k, v, g, beta, state)
    assert torch.backends.mkldnn.enabled
    with fast_paths(delta_chunks=False):
        assert not delta_chunks_take(q, k, v, g, beta, state)
        torch_out, _ = gated_delta_prefill(**inputs, lengths=lengths)
    out, final = gated_delta_prefill(**inputs, lengths=lengths)
    kernel_out, kernel_final = delta_chunks(**inputs, lengths=lengths, flush=FLUSH)
    assert torch.equal(out, kernel_out) and torch.equal(final, kernel_final)
    assert not torch.equal(out[0], torch_out[0])  # the torch path's fp32 products round otherwise
    _assert_within_bf16(out[0], torch_out[0].double(), "kernel vs torch path")


@pytest.mark.parametrize("chunk", [1, 2, 7, 63, 64, 100])
@pytest.mark.parametrize("dims", [(18, 10), (24, 40)], ids=["dk18", "dk24"])
def test_every_chunk_size_and_odd_widths_keep_the_exact_rule_within_bf16(chunk: int, dims: tuple[int, int]) -> None:
    """Chunks of any size (odd ones pad the tokens' product dimension), key and value widths off the 16-lane vectors."""
    _kernels()
    inputs = _inputs(2, 131, (1, 3), dims, seed=chunk)
    lengths = torch.tensor([131, 50])
    kernels = native()
    assert kernels is not None
    args = (inputs[n] for n in ("q", "k", "v", "g", "beta", "state"))
    out, final = kernels.delta_chunks(*args, lengths, chunk, FLUSH)
    want_out, want_final = _exact(inputs, lengths)
    _assert_within_bf16(out[0], want_out[0], "full row")
    _assert_within_bf16(out[1, :50], want_out[1, :50], "short row")
    _assert_within_bf16(final, want_final, "final state")


def test_rows_read_through_strides_equal_contiguous_copies() -> None:
    """q, k and v as the layer passes them: views of one conv output split along its last dimension."""
    _kernels()
    inputs = _inputs(2, 33, (2, 4), (16, 8), seed=9)
    mixed = torch.cat([inputs[n].flatten(2) for n in ("q", "k", "v")], dim=-1)
    q, k, v = torch.split(mixed, [32, 32, 32], dim=-1)
    views = {"q": q.view(2, 33, 2, 16), "k": k.view(2, 33, 2, 16), "v": v.view(2, 33, 4, 8)}
    assert not views["q"].is_contiguous()
    got = delta_chunks(**{**inputs, **views}, lengths=None, flush=FLUSH)
    want = delta_chunks(**inputs, lengths=None, flush=FLUSH)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_decays_are_flushed_only_when_asked() -> None:
    _kernels()
    inputs = _inputs(1, 64, (1, 1), (16, 8), seed=13, steep=20.0)
    flushed = delta_chunks(**inputs, lengths=None, flush=FLUSH)
    kept = delta_chunks(**inputs, lengths=None, flush=float("inf"))
    want_out, _ = _exact(inputs)
    _assert_within_bf16(flushed[0], want_out, "flushed")
    _assert_within_bf16(kept[0], want_out, "unflushed")
    seen: list[float] = []

    def spy(*args: torch.Tensor | float | None) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(float(args[-1]))  # type: ignore[arg-type]
        return delta_chunks(*args)  # type: ignore[arg-type]

    for flush in (True, False):
        with fast_paths(flush_decays=flush), pytest.MonkeyPatch.context() as patch:
            patch.setattr(gated_delta, "delta_chunks", spy)
            gated_delta_prefill(**inputs)
    assert seen == [FLUSH, float("inf")]


def _call(**changes: object) -> None:
    args: dict[str, object] = {**_inputs(2, 6, (2, 4), (16, 8), seed=1), "lengths": torch.tensor([6, 3])}
    args.update(changes)
    kernels = native()
    assert kernels is not None
    kernels.delta_chunks(
        args["q"], args["k"], args["v"], args["g"], args["beta"], args["state"], args["lengths"], 64, FLUSH
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"q": torch.zeros(2, 6, 2, 16)}, r"q, k, v bf16 CPU tensors.*Float"),
        ({"q": torch.zeros(2, 6, 2, 15).bfloat16(), "k": torch.zeros(2, 6, 2, 15).bfloat16()}, r"even key dimension"),
        ({"k": torch.zeros(2, 6, 1, 16).bfloat16()}, r"q, k \(B, T, HK, dk\).*\[2, 6, 2, 16\] \[2, 6, 1, 16\]"),
        ({"v": torch.zeros(2, 6, 3, 8).bfloat16()}, r"value heads \(3\) a multiple of key heads \(2\)"),
        ({"g": torch.zeros(2, 5, 4)}, r"g and beta contiguous fp32 \(2, 6, 4\), got Float \[2, 5, 4\]"),
        ({"beta": torch.zeros(2, 6, 4).bfloat16()}, r"g and beta contiguous fp32.*BFloat16"),
        ({"state": torch.zeros(2, 4, 8, 16)}, r"state contiguous fp32 \(2, 4, 16, 8\), got Float \[2, 4, 8, 16\]"),
        ({"lengths": torch.tensor([6, 7])}, r"lengths\[1\] = 7 outside \[0, 6\]"),
        ({"lengths": torch.tensor([6, -1])}, r"lengths\[1\] = -1 outside \[0, 6\]"),
        ({"lengths": torch.tensor([6])}, r"lengths a contiguous int64 \(2\) CPU tensor"),
    ],
)
def test_malformed_arguments_are_refused_naming_what_they_got(changes: dict[str, object], message: str) -> None:
    _kernels()
    with pytest.raises(RuntimeError, match=message):
        _call(**changes)
