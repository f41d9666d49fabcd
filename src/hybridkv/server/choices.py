"""Several outputs of one prompt (OpenAI's ``n``, SGLang's ``sampling_params.n``): each is its own request.

Invariants: a prompt gives 1 to ``MAX_CHOICES`` outputs (another count is a 400 naming the field); output ``j``
samples with the prompt's parameters, a given seed moved by ``j`` (so the outputs differ, and each is
reproducible), else the engine seeds each request itself. The copies after the first find the prompt in the
prefix cache: the prompt is computed about once.
"""

from __future__ import annotations

import dataclasses

from hybridkv.engine.sched.request import MAX_SEED, SamplingParams
from hybridkv.server.schemas import ApiError

MAX_CHOICES = 64


def choices_per_prompt(n: int | None, field: str = "n") -> int:
    """``n`` checked (None: 1)."""
    if n is None:
        return 1
    if isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"{field}: {n} outputs per prompt; give 1 to {MAX_CHOICES}", field)
    return n


def nth(params: SamplingParams, j: int) -> SamplingParams:
    """Output ``j``'s parameters: a given seed moves by ``j`` (else the engine gives each request its own)."""
    if params.seed is None or j == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % (MAX_SEED + 1))
