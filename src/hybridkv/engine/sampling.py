"""Next-token choice: greedy, or seeded sampling that is independent of batching and retraction.

A sampled token depends only on the logits, the request's seed and the position it
fills: the noise comes from a generator seeded with ``(seed, position)``, so a request
resumed after retraction (or batched differently) draws the same token.
"""

from __future__ import annotations

import torch


def choose_tokens(logits: torch.Tensor, temperatures: list[float], seeds: list[int], positions: list[int]) -> list[int]:
    """One token per row of ``logits`` ``(R, vocab)``; temperature 0 is greedy."""
    chosen: list[int] = torch.argmax(logits, dim=-1).tolist()  # the step's one read of the device
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    if sampled:
        rows = logits[sampled].float().cpu()
        noise = torch.empty_like(rows)
        for j, i in enumerate(sampled):
            g = torch.Generator().manual_seed(seeds[i] * 1_000_003 + positions[i])
            u = torch.rand(rows.shape[1], generator=g).clamp_(min=1e-20)
            noise[j] = -torch.log(-torch.log(u))  # argmax(logits / T + Gumbel) ~ softmax(logits / T)
        temps = torch.tensor([temperatures[i] for i in sampled], dtype=rows.dtype)[:, None]
        for i, token in zip(sampled, torch.argmax(rows / temps + noise, dim=-1).tolist(), strict=True):
            chosen[i] = token
    return chosen
