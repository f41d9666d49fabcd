"""Switches for the engine's CPU fast paths, all on by default; the benchmarks turn them off for their side-by-side
baseline in the same run (``hybridkv bench bf16``).

- ``packed_linears``: bf16 projections, logits and routed experts through oneDNN with the weights packed once
  (``layers.linear``);
- ``packed_fp32``: fp32 projections and logits through oneDNN with the weights packed once, where that pays on this
  CPU (``layers.linear.fp32_packing``; ``F.linear``'s MKL sgemm elsewhere): on an Intel CPU 4 to 128 rows and at least
  2**22 multiply-adds, on another x86 CPU (MKL's AVX2 code there) every call from 2**20. Not bit-equal (another
  summation order), within fp32 rounding. Engine, widened tiny-gemma3 / -dense fp32 (``scripts/fast_path_ab.py ...
  --dtype float32``, 6 rounds), on/off, an AMX Xeon: random 0.979 / 0.966, shared 0.917 / 0.987, alone 1.020 / 1.071
  (alone takes no packed call: the noise floor). Widened tiny-gemma3-dense fp32, an AMD EPYC (Zen 5), the Intel rule
  -> this CPU's, in-process, median of 3 alternating, 64 prompts of 128 tokens + 16 new at once: 2788 -> 1567 ms (a
  2048-token prefill step 588 -> 284 ms); 64 of a cached 128-token prefix + 16: 681 -> 523 ms; one alone: 112 ->
  109 ms (its decode rows take the skinny kernel either way).
- ``in_place_states``: recurrent states stay where they are: a recurrent layer's one-token decode (GatedDeltaNet,
  KDA) updates its fp32 state in the step's state rows instead of making new state-sized tensors and copying them
  back; its row-times-state matmuls read the state inside its cell (one ``bmm`` per head, no folding copy); the
  step's cells gather into a reused buffer per state pool (``StateLayout.workspace``: no page faults each step).
- ``rms_norms``: a bf16 / fp16 RMS norm on the CPU normalises its fp32 copy in place (``norms.rms_norm_rounded``)
  instead of through torch's composite, which makes a fresh fp32 tensor at each step.
- ``native_kernels``: the C++ CPU kernels (``ops.native``; built once per machine, skipped where they cannot be),
  e.g. the greedy choice over the logits in one read (``ops.greedy``).
- ``paged_decode``: bf16 and fp32 decode rows attend straight from the pool's pages (``ops.paged_decode``, a C++
  kernel) instead of a gathered copy; equal within the dtype's rounding, not bit-equal.
- ``paged_spans``: likewise the rows of more than one new token (``ops.paged_spans``): a prefill chunk or a prompt's
  tail on a cached prefix reads its keys from the pages, with no gathered copy, padding or mask; the pool gathers
  nothing; within the dtype's rounding.
- ``flush_decays``: the chunked gated delta rule (``ops.gated_delta``) sets its decay factors below ``e**-30`` to
  exactly zero instead of letting them (and their products) become denormal floats, which the CPU multiplies about
  ten times slower (widened Qwen3-Next bf16 prefill: its fp32 chunk matmuls 371 -> 66 ms of a 1.5 s step); the
  terms dropped are below fp32's rounding of every output, so not bit-equal but equal within fp32 rounding.
- ``fp32_conv``: the causal conv (``ops.conv``) of a bf16 / fp16 model on the CPU accumulates its taps in fp32 and
  rounds once (widened Qwen3-Next prefill chunk, 2 x 384 tokens x 1024 channels: 5.2 -> 2.8 ms); closer to fp32 than
  the per-tap bf16 rounding it replaces, so not bit-equal.
- ``dense_experts``: Qwen3-Next's routed experts of a few tokens (a decode step) run densely, every expert on every
  token in two packed matmuls that also sum the experts (``layers.dense_moe``), instead of two oneDNN calls per
  chosen expert; within bf16 rounding (the sum rounded once), not bit-equal.
- ``fused_norms``: a bf16 or fp32 RMS norm on the CPU in one pass per row (``ops.rms_norm``, a C++ kernel), the
  residual add after it fused in (Gemma 3's sandwich norms); its mean of squares is summed in fp64: a few bf16
  outputs in a million one step from the torch path's, at least as close to fp32's; fp32 within an ulp or two.
  GatedDeltaNet's gated output norm likewise in one pass, its gate read in place from the projection (no reshape
  copy); widened Qwen3-Next bf16, 2048 x 4 x 128: ~3.6 -> ~1.4 ms.
- ``fused_activations``: a gated MLP's ``act(gate) * up`` in one pass (``ops.gated_act``, a C++ kernel; tanh GELU
  and SiLU, bf16 and fp32): rounded once in bf16 (the torch path rounds twice), within a few ulp in fp32.
- ``fused_rope``: attention's query and key norms and rotary embedding in one pass (``ops.qk_rope``, a C++ kernel,
  bf16 or fp32; no concatenated copy, the rotation on the unrounded norm): within the dtype's rounding, closer to
  the exact values in bf16.
- ``put_entries``: a step's new K/V go into the pool's pages and the step's key buffer by a byte copy each
  (``ops.put_entries``, a C++ kernel) instead of indexed stores into strided views; bit-equal.
- ``band_attention``: bf16 prefill rows of a sliding-window layer attend over only each query's window of the keys
  (``ops.band_attention``, a C++ kernel) instead of SDPA over every column; within bf16 rounding.
- ``state_cells``: no whole state cell is gathered and written back each step (``forward.pool_io.StateIO``): a
  GatedDeltaNet decode updates its conv windows and fp32 state where they lie in the state pool, by cell
  (``ops.conv_cells``, ``ops.gdn_cells``: C++ kernels, two passes over the state; widened Qwen3-Next cells are half a
  megabyte), its prefill gathers and writes back its group's windows and states alone, every other state tensor is
  gathered alone on first use; within fp32 rounding (the kernels' sums and SiLU), not bit-equal.
- ``row_buckets``: a packed routed expert's run of more than 64 rows (``layers.routing``) is widened to a multiple of
  64, so that oneDNN's kernels compiled for a row count are reused instead of compiled again for each step's run
  lengths (~4 ms each); within bf16 rounding.
- ``skinny_linears``: a projection, routed expert or logits of one or two bf16 rows (fp32: up to four) streams its
  weight through a C++ kernel (``ops.skinny_linear``) instead of oneDNN's or MKL's call, whose fixed cost dominates
  a decode's small shapes; within the dtype's rounding (another summation order).
- ``fused_experts``: Qwen3-Next's routed experts of up to four tokens (a decode step) run in one C++ call
  (``ops.moe_decode``: each token's chosen experts' gated MLPs, weighted and summed) instead of the routed or dense
  path's dozen torch calls; within the dtype's rounding (the activation and the sum rounded once).
- ``delta_chunks``: the chunked gated delta rule of bf16 inputs (a GatedDeltaNet prefill) in one C++ call
  (``ops.delta_chunks``), each chunk's products bf16 with fp32 sums on ATen's brgemm (AMX tiles where the CPU has them)
  or AVX-512 BF16, instead of the torch path's fp32 products; within bf16's rounding (the products' operands rounded to
  bf16, as FLA's kernels round them).

Each computes the same numbers as the path it replaces (bit-equal where measured) or, where listed in ``ROUNDING``,
numbers within the dtype's (``flush_decays``: fp32's) rounding of them; they change only the cost.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class FastPaths:
    packed_linears: bool = True
    packed_fp32: bool = True
    in_place_states: bool = True
    rms_norms: bool = True
    native_kernels: bool = True
    paged_decode: bool = True
    paged_spans: bool = True
    flush_decays: bool = True
    fp32_conv: bool = True
    dense_experts: bool = True
    fused_norms: bool = True
    fused_activations: bool = True
    fused_rope: bool = True
    put_entries: bool = True
    band_attention: bool = True
    state_cells: bool = True
    row_buckets: bool = True
    skinny_linears: bool = True
    fused_experts: bool = True
    delta_chunks: bool = True


ROUNDING = (
    "packed_fp32",
    "paged_decode",
    "paged_spans",
    "flush_decays",
    "fp32_conv",
    "dense_experts",
    "fused_norms",
    "fused_activations",
    "fused_rope",
    "band_attention",
    "state_cells",
    "row_buckets",
    "skinny_linears",
    "fused_experts",
    "delta_chunks",
)
"""The switches whose paths round differently from the ones they replace (within the dtype's rounding)."""

FAST = FastPaths()


@contextlib.contextmanager
def fast_paths(on: bool | None = None, **which: bool) -> Iterator[FastPaths]:
    """Every switch set to ``on`` (when given), then the named ones (``packed_linears=False``), inside the block."""
    before = dataclasses.replace(FAST)
    names = [f.name for f in dataclasses.fields(FAST)]
    unknown = sorted(set(which) - set(names))
    if unknown:
        raise ValueError(f"unknown fast paths {unknown}; known: {names}")
    for name in names:
        setattr(FAST, name, which.get(name, getattr(FAST, name) if on is None else on))
    try:
        yield FAST
    finally:
        for name in names:
            setattr(FAST, name, getattr(before, name))
