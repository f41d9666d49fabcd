"""Log-probabilities of the tokens a step chose, for the requests that ask (``SamplingParams.logprobs``).

A token's log-probability is read off the model's raw distribution at the position it fills: the
log-softmax of the row's logits in fp32, before temperature, top-k or top-p (what vLLM and SGLang
report by default), so a sampled token's figure does not depend on how it was drawn. With
``logprobs = n`` the ``n`` most likely tokens of that distribution and theirs come with it.

Invariants:
- Rows that did not ask cost nothing: a step where no chosen row asks reads nothing and computes
  nothing; one that does computes the rows that asked only, and reads them from the device in two
  copies (the log-probabilities, the top ids).
- ``TokenLogprob.top`` holds ``n`` entries, most likely first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """The ``n`` most likely tokens at this position and their log-probabilities, most likely first."""


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], tops: Sequence[int]
) -> list[TokenLogprob]:
    """One ``TokenLogprob`` per ``rows[i]`` of ``logits`` ``(R, vocab)``: ``tokens[i]``'s log-probability and the
    ``tops[i]`` most likely tokens'."""
    if not rows:
        return []
    picked = logits[list(rows)].float()
    logp = torch.log_softmax(picked, dim=-1)
    chosen = logp.gather(1, torch.tensor(list(tokens), dtype=torch.long, device=logp.device)[:, None])[:, 0]
    widest = max(tops)
    top = torch.topk(logp, widest, dim=-1) if widest else None
    values = chosen[:, None] if top is None else torch.cat([chosen[:, None], top.values], dim=1)
    host_values = values.cpu().tolist()
    host_ids = [[] for _ in rows] if top is None else top.indices.cpu().tolist()
    out = []
    for token, n, vals, ids in zip(tokens, tops, host_values, host_ids, strict=True):
        out.append(TokenLogprob(int(token), float(vals[0]), tuple(zip(ids[:n], vals[1 : n + 1], strict=True))))
    return out


def prompt_logprobs(
    logits: torch.Tensor,
    starts: Sequence[int],
    spans: Sequence[int],
    prompts: Sequence[Sequence[int]],
    tops: Sequence[int],
) -> list[list[TokenLogprob]]:
    """Per row, the log-probabilities of its prompt tokens at positions ``start + 1 .. start + span`` (those inside
    the prompt): ``logits`` holds the rows' logits at every position of their spans, one row after the other
    (position ``p``'s logits give token ``p + 1``'s)."""
    rows: list[int] = []
    tokens: list[int] = []
    top_of: list[int] = []
    owner: list[int] = []
    at = 0
    for i, (start, span, ids, n) in enumerate(zip(starts, spans, prompts, tops, strict=True)):
        last = min(start + span, len(ids) - 1)  # the position whose token is the prompt's last
        rows += range(at, at + last - start)
        tokens += ids[start + 1 : last + 1]
        top_of += [n] * (last - start)
        owner += [i] * (last - start)
        at += span
    out: list[list[TokenLogprob]] = [[] for _ in starts]
    for i, logprob in zip(owner, token_logprobs(logits, rows, tokens, top_of), strict=True):
        out[i].append(logprob)
    return out
