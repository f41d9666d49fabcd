"""Causal conv1d with a carried window vs transformers' causal_conv1d_fn / causal_conv1d_update."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn, causal_conv1d_update

from hybridkv.engine.fast_paths import fast_paths
from hybridkv.engine.ops import causal_conv1d_decode, causal_conv1d_prefill

from .chunking import assert_close, pad_ragged, spans, unpad_ragged

# fp32, inputs ~N(0,1), kernel 4: a handful of products per output; measured max diff 6e-8.
ATOL = 1e-6
CHANNELS, KERNEL = 12, 4


def _weights(bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(CHANNELS, KERNEL, generator=gen)
    return weight, (torch.randn(CHANNELS, generator=gen) if bias else None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_prefill_from_zero_matches_reference(bias: bool, activation: str | None) -> None:
    weight, b = _weights(bias)
    x = torch.randn(3, 19, CHANNELS, generator=torch.Generator().manual_seed(2))
    out, window = causal_conv1d_prefill(x, torch.zeros(3, CHANNELS, KERNEL - 1), weight, b, activation)
    ref = causal_conv1d_fn(x.transpose(1, 2), weight, b, activation=activation).transpose(1, 2)
    assert_close(out, ref, ATOL, "prefill output")
    assert torch.equal(window, x[:, -(KERNEL - 1) :].transpose(1, 2))


def test_short_prefill_window_keeps_zeros_of_the_empty_past() -> None:
    weight, b = _weights(True)
    x = torch.randn(2, 2, CHANNELS)
    _, window = causal_conv1d_prefill(x, torch.zeros(2, CHANNELS, KERNEL - 1), weight, b, "silu")
    assert torch.equal(window[:, :, 0], torch.zeros(2, CHANNELS))
    assert torch.equal(window[:, :, 1:], x.transpose(1, 2))


def test_decode_matches_reference_update() -> None:
    weight, b = _weights(True)
    gen = torch.Generator().manual_seed(3)
    window = torch.randn(4, CHANNELS, KERNEL - 1, generator=gen)
    x = torch.randn(4, CHANNELS, generator=gen)
    # The reference keeps `kernel` inputs; its oldest one never reaches the output.
    ref_state = torch.cat([torch.randn(4, CHANNELS, 1, generator=gen), window], dim=-1)
    ref = causal_conv1d_update(x[:, :, None], ref_state, weight, b, "silu")[:, :, 0]
    out, new_window = causal_conv1d_decode(x, window, weight, b, "silu")
    assert_close(out, ref, ATOL, "decode output")
    assert torch.equal(new_window, ref_state[:, :, 1:])


def test_chunked_prefill_and_decode_equal_one_pass() -> None:
    weight, b = _weights(True)
    x = torch.randn(2, 150, CHANNELS, generator=torch.Generator().manual_seed(4))
    whole, whole_window = causal_conv1d_prefill(x, torch.zeros(2, CHANNELS, KERNEL - 1), weight, b, "silu")
    window = torch.zeros(2, CHANNELS, KERNEL - 1)
    pieces = []
    for start, end in spans(140):
        out, window = causal_conv1d_prefill(x[:, start:end], window, weight, b, "silu")
        pieces.append(out)
    for t in range(140, 150):
        out, window = causal_conv1d_decode(x[:, t], window, weight, b, "silu")
        pieces.append(out[:, None])
    assert_close(torch.cat(pieces, dim=1), whole, ATOL, "chunked output")
    assert torch.equal(window, whole_window)


def test_ragged_batch_equals_each_request_alone() -> None:
    weight, b = _weights(True)
    gen = torch.Generator().manual_seed(5)
    lengths = [1, 9, 2, 5]
    windows = torch.randn(len(lengths), CHANNELS, KERNEL - 1, generator=gen)
    flat = torch.randn(sum(lengths), CHANNELS, generator=gen)
    lens = torch.tensor(lengths)
    starts = torch.cumsum(lens, 0) - lens
    padded = pad_ragged(flat, starts, lens, max(lengths))
    out, new_windows = causal_conv1d_prefill(padded, windows, weight, b, "silu", lengths=lens)
    flat_out = unpad_ragged(out, lens, sum(lengths))
    for row, (start, n) in enumerate(zip(starts.tolist(), lengths, strict=True)):
        alone, alone_window = causal_conv1d_prefill(
            flat[None, start : start + n], windows[row : row + 1], weight, b, "silu"
        )
        assert_close(flat_out[start : start + n], alone[0], ATOL, f"row {row} output")
        assert torch.equal(new_windows[row], alone_window[0])


def test_window_of_wrong_shape_is_refused() -> None:
    weight, b = _weights(False)
    with pytest.raises(ValueError, match=r"expected \(2, 12, 3\)"):
        causal_conv1d_prefill(torch.zeros(2, 5, CHANNELS), torch.zeros(2, CHANNELS, KERNEL), weight, b, None)
    with pytest.raises(ValueError, match="unsupported activation 'gelu'"):
        causal_conv1d_decode(torch.zeros(2, CHANNELS), torch.zeros(2, CHANNELS, KERNEL - 1), weight, b, "gelu")


def test_bf16_taps_in_fp32_are_closer_to_fp32_and_keep_the_window_exact() -> None:
    """``fp32_conv``: a bf16 conv accumulates in fp32 and rounds once, so it is nearer the fp32 conv than the per-tap
    bf16 rounding (both compared with the fp32 result of the same bf16 inputs); the window is the inputs either way."""
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(256, KERNEL, generator=gen) * 0.5).bfloat16()
    x = torch.randn(2, 64, 256, generator=gen).bfloat16()
    window = torch.randn(2, 256, KERNEL - 1, generator=gen).bfloat16()
    ref, _ = causal_conv1d_prefill(x.float(), window.float(), weight.float(), None, "silu")
    errors, windows, decodes = {}, {}, {}
    for on in (False, True):
        with fast_paths(fp32_conv=on):
            out, windows[on] = causal_conv1d_prefill(x, window, weight, None, "silu")
            decodes[on], _ = causal_conv1d_decode(x[:, 0], window, weight, None, "silu")
        assert out.dtype == torch.bfloat16
        errors[on] = (out.float() - ref).abs().max().item()
    assert errors[True] < errors[False]
    assert errors[True] <= ref.abs().max().item() * 2**-8  # one bf16 rounding
    assert torch.equal(windows[True], windows[False])
    assert torch.equal(windows[True], x[:, -(KERNEL - 1) :].transpose(1, 2))
    # decode is the one-token case of the same arithmetic (summed in another order: within one bf16 rounding)
    assert_close(decodes[True].float(), out[:, 0].float(), ref.abs().max().item() * 2**-8, "decode vs prefill")
