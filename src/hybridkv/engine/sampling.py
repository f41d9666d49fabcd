"""Next-token choice: greedy, or seeded sampling that is independent of batching, retraction and layout.

A sampled token depends only on the logits, the request's ``SamplingParams`` and the position
it fills: the noise comes from a generator seeded with ``(seed, position)`` and the choice is
``argmax(filtered logits / temperature + Gumbel noise)`` (a draw from the softmax), so a request
resumed after retraction, batched differently, or served disaggregated (the first token on the
prefill engine, the rest on the decode engine) draws the same tokens. ``top_k`` keeps the k
largest logits, ``top_p`` the smallest set of most likely tokens whose probability reaches p.

Invariants:
- One host read of the device per call for greedy rows (argmax and the finite check together);
  sampled rows are filtered and drawn on the host in fp32.
- A row with a non-finite logit gets ``NON_FINITE`` instead of a token: the caller fails that
  request with a reason, never serves a token chosen from NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.engine.request import SamplingParams

NON_FINITE = -1
"""The choice for a row whose logits hold NaN or inf."""


def _filtered(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``row / temperature`` with every token outside top-k / top-p set to -inf."""
    scaled = row / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        order = torch.argsort(scaled, descending=True)
        probs = torch.softmax(scaled[order], dim=0)
        before = torch.cumsum(probs, dim=0) - probs  # mass of the tokens more likely than each
        drop = order[before >= params.top_p]
        scaled = scaled.index_fill(0, drop, float("-inf"))
    return scaled


def choose_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
    """One token per row of ``logits`` ``(R, vocab)``; ``params[i].temperature == 0`` is greedy.
    ``positions[i]``: the position the token fills (its request's length so far)."""
    finite = torch.isfinite(logits).all(dim=-1)
    picked = torch.where(finite, torch.argmax(logits, dim=-1), NON_FINITE)
    chosen: list[int] = picked.tolist()  # the step's one read of the device
    sampled = [i for i, p in enumerate(params) if not p.greedy and chosen[i] != NON_FINITE]
    if sampled:
        rows = logits[sampled].float().cpu()
        for j, i in enumerate(sampled):
            p = params[i]
            seed = 0 if p.seed is None else p.seed
            g = torch.Generator().manual_seed((seed * 1_000_003 + positions[i]) % (2**63))
            u = torch.rand(rows.shape[1], generator=g).clamp_(min=1e-20)
            gumbel = -torch.log(-torch.log(u))
            chosen[i] = int(torch.argmax(_filtered(rows[j], p) + gumbel))
    return chosen
