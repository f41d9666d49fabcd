"""Log-probabilities in the shapes clients read: OpenAI's completions object and SGLang's ``meta_info`` lists.

OpenAI (``/v1/completions``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per
token; a token with no figure (a prompt's first, with ``echo``) has ``null`` log-probability and top. SGLang
(``/generate``): ``[logprob, token_id, text]`` per token (``text`` null unless ``return_text_in_logprobs``), and
per token a list of such triples for the most likely ones.

A token's text is its tokenizer's decoding of that one id; without a tokenizer it is ``token_id:N`` (vLLM's
``return_tokens_as_token_ids`` spelling), so two tokens never share a name in a ``top_logprobs`` map.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.engine.logprobs import TokenLogprob
from hybridkv.server.text import TextTokenizer


def token_text(tokenizer: TextTokenizer | None, token: int) -> str:
    return f"token_id:{token}" if tokenizer is None else tokenizer.decode([token])


def openai_logprobs(
    tokenizer: TextTokenizer | None,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    text_offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object of ``token_ids`` (``entries[i]``: token ``i``'s figure, None for
    none); ``text_offset``: where the first token's text starts in the choice's text."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [
            None if e is None else {token_text(tokenizer, t): value for t, value in e.top} for e in entries
        ],
        "text_offset": offsets,
    }


def sglang_logprobs(
    tokenizer: TextTokenizer | None,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    with_text: bool,
) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """SGLang's ``(token_logprobs, top_logprobs)`` of ``token_ids``: ``[logprob, id, text]`` per token, and per
    token its most likely ones as such triples (None where the token has no figure)."""

    def text(token: int) -> str | None:
        return token_text(tokenizer, token) if with_text else None

    chosen = [[None if e is None else e.logprob, t, text(t)] for t, e in zip(token_ids, entries, strict=True)]
    top = [None if e is None else [[value, t, text(t)] for t, value in e.top] for e in entries]
    return chosen, top
