"""The chunked gated delta rule of bf16 inputs in one C++ call (``csrc/delta_chunks.cpp``): each chunk's products as
bf16 matrix products with fp32 sums (ATen's brgemm: AMX tiles where the CPU has them; on a CPU without AMX whose
AVX-512 has BF16, e.g. AMD Zen 4/5, the kernel's own VDPBF16PS blocks on the same operands). One thread, a Zen 5,
16 rows x 128 tokens, 4 value heads of 128 x 128: 24 ms a call with one row of A a block, 11.9 ms with four;
widened Qwen3-Next bf16, the torch path -> the kernel (``scripts/fast_path_ab.py tiny-qwen3-next delta_chunks 5``):
64 prompts of 144 tokens at once 1063 -> 926 ms, 64 on a cached prefix 372 -> 356 ms, one alone 63.3 -> 60.2 ms.

``ops.gated_delta``'s torch path makes the same products in fp32 (transformers' ``torch_chunk_gated_delta_rule``
operation for operation), a compute-bound third of a widened Qwen3-Next bf16 prefill step on this CPU; vLLM's and
SGLang's CPU backends call a C++ kernel of the same kind. Per (row, value head), in chunks of ``KERNEL_CHUNK`` from the
call's first token, the state carried in fp32.

When (``delta_chunks_take``): bf16 q, k, v on the CPU with an even key dimension, the C++ kernels built and able to
multiply bf16 here (ATen's brgemm, or AVX-512 BF16) with oneDNN on (``torch.backends.mkldnn``),
``fast_paths(delta_chunks=...)`` and ``native_kernels`` on, not inside a graph being traced, no gradient recorded for
any input.

Numerics: every product's operands are rounded to bf16 (the normalised keys and queries, the intra-chunk inverse, the
state), as FLA's GPU kernels round them; the sums, the state and the decays stay fp32: within bf16's rounding of the
fp32 path, not equal to it. Decay factors below ``e**-flush`` are zero (``gated_delta.FLUSH`` with ``flush_decays``
on, as the torch path flushes them).
"""

from __future__ import annotations

import functools

import torch

from hybridkv.engine.fast_paths import FAST
from hybridkv.engine.ops.native import native

KERNEL_CHUNK = 64
"""The kernel's chunk: with the products on AMX tiles each chunk's cost is mostly its fixed work, so the larger of
FLA's chunks (the torch path's 32 is the fp32 products' best)."""


@functools.cache
def _kernel_runs_bf16() -> bool:
    """Whether the kernel multiplies bf16 on this CPU (ATen's brgemm, or AVX-512 BF16); asked only while oneDNN is on
    (``delta_chunks_take`` checks that first, on every call: ATen's brgemm refuses while a user turned it off)."""
    kernels = native()
    return kernels is not None and bool(kernels.delta_chunks_ready())


def delta_chunks_take(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> bool:
    """Whether ``delta_chunks(q, k, v, g, beta, state, ...)`` runs the kernel for these inputs."""
    if torch.compiler.is_compiling():  # first: a traced graph keeps the torch path
        return False
    return (
        FAST.delta_chunks
        and FAST.native_kernels
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and q.is_cpu
        and k.is_cpu
        and v.is_cpu
        and k.shape[-1] % 2 == 0
        and k.shape[-1] > 0
        and v.shape[-1] > 0
        and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, state)))
        and bool(torch.backends.mkldnn.enabled)
        and _kernel_runs_bf16()
    )


def delta_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lengths: torch.Tensor | None,
    flush: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta.gated_delta_prefill``'s arguments (q, k ``[batch, seq, heads_k, dk]``, v ``[batch, seq, heads_v,
    dv]``, g, beta ``[batch, seq, heads_v]``, state ``[batch, heads_v, dk, dv]``, lengths ``[batch]`` or None) ->
    ``(out [batch, seq, heads_v, dv] bf16, zero past each row's length; final state fp32)``; decays below
    ``e**-flush`` are zero (``math.inf``: none); ``delta_chunks_take(q, k, v, g, beta, state)`` must hold."""
    kernels = native()
    assert kernels is not None, "delta_chunks_take said the kernels are built"
    batch, seq = q.shape[:2]
    if lengths is None:
        lengths = torch.full((batch,), seq, dtype=torch.int64)
    rows = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    gates = (x.to(torch.float32).contiguous() for x in (g, beta))
    out, final = kernels.delta_chunks(
        *rows,
        *gates,
        state.to(torch.float32).contiguous(),
        lengths.to(torch.int64).contiguous(),
        KERNEL_CHUNK,
        flush,
    )
    return out, final
