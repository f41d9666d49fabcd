"""Next-token choice: greedy, or seeded sampling that is independent of batching, retraction and layout.

A sampled token depends only on the logits, the request's ``SamplingParams`` and the position
it fills: the noise comes from a generator seeded with ``(seed, position)`` and the choice is
``argmax(filtered logits / temperature + Gumbel noise)`` (a draw from the softmax), so a request
resumed after retraction, batched differently, or served disaggregated (the first token on the
prefill engine, the rest on the decode engine) draws the same tokens. ``top_k`` keeps the k
largest logits, ``top_p`` the smallest set of most likely tokens whose probability reaches p.

Invariants:
- At most two host reads of the device per call: the greedy choice of every row (argmax and the
  finite check together), and the sampled rows' logits, copied at once; those are filtered and
  drawn on the host in fp32, in blocks of rows (each by its own parameters and noise: one row's
  draw never depends on the others).
- A row with a non-finite logit gets ``NON_FINITE`` instead of a token: the caller fails that
  request with a reason, never serves a token chosen from NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.engine.ops.greedy import NON_FINITE, greedy
from hybridkv.engine.sched.request import SamplingParams

SAMPLE_BLOCK = 2**18
"""Logits drawn at once (rows of the sampled ones): the rows' temporaries stay in cache. Tiny vocabularies draw every
row together (64 rows of 256 with top-k and top-p: 9.2 -> 1.5 ms); a real one (152k) about a row at a time."""


def _filtered(rows: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``rows / temperature`` (one row per request of ``params``) with every token outside each row's top-k / top-p
    set to -inf: the rows at once (one top-k, one sort), each by its own parameters."""
    vocab = rows.shape[1]
    scaled = rows / torch.tensor([p.temperature for p in params], dtype=rows.dtype)[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        largest = torch.topk(scaled, max(ks), dim=-1).values  # sorted: column k - 1 is a row's k-th largest
        kth = largest.gather(1, torch.tensor([max(k, 1) - 1 for k in ks])[:, None])
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks])[:, None], float("-inf"))  # rows without top-k
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens more likely than each
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], dtype=probs.dtype)
        drop = torch.zeros_like(ordered, dtype=torch.bool).scatter_(1, order, before >= top_p[:, None])
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def _gumbel(params: Sequence[SamplingParams], positions: Sequence[int], vocab: int) -> torch.Tensor:
    """``(rows, vocab)`` Gumbel noise, row ``i`` from a generator seeded with its request's seed and position (a row's
    noise never depends on the others)."""
    u = torch.empty(len(params), vocab)
    for i, (p, position) in enumerate(zip(params, positions, strict=True)):
        seed = 0 if p.seed is None else p.seed
        torch.rand(vocab, generator=torch.Generator().manual_seed((seed * 1_000_003 + position) % (2**63)), out=u[i])
    return -torch.log(-torch.log(u.clamp_(min=1e-20)))


def choose_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
    """One token per row of ``logits`` ``(R, vocab)``; ``params[i].greedy`` (temperature 0, or below ``GREEDY_BELOW``)
    takes the argmax.
    ``positions[i]``: the position the token fills (its request's length so far)."""
    chosen: list[int] = greedy(logits).tolist()  # the step's one read of the device
    sampled = [i for i, p in enumerate(params) if not p.greedy and chosen[i] != NON_FINITE]
    if sampled:
        vocab = logits.shape[1]
        host = logits[sampled].float().cpu()  # the sampled rows' one read of the device
        block = max(1, SAMPLE_BLOCK // vocab)
        for at in range(0, len(sampled), block):
            rows_of = sampled[at : at + block]
            these = [params[i] for i in rows_of]
            rows = _filtered(host[at : at + block], these)
            drawn = torch.argmax(rows + _gumbel(these, [positions[i] for i in rows_of], vocab), dim=-1)
            for i, token in zip(rows_of, drawn.tolist(), strict=True):
                chosen[i] = token
    return chosen
