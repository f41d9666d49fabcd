"""The ``transformers`` contenders of ``bench engine``, and the clock that prices a computed token per phase.

Each contender runs the whole workload and answers ``(outputs, computed positions, extra)``:
``one_by_one`` (``generate`` per request, the exactness oracle), ``padded`` (``generate`` on
left-padded batches, ``fast_attention``: sdpa where the model supports it) and ``continuous``
(``generate_batch``, transformers' continuous batching).

``PhaseClock`` counts the input positions of every forward of a model (padding included: what
the forward computed) and splits the CPU of the block between two phases by the forwards' shape:
*prefill* (a forward over more than one position per row) and *decode* (one position per row).
A phase runs from its first forward to the next forward of the other phase, so ``generate``'s own
work between decode forwards (sampling, stopping checks, growing the ids) is decode's, and the
input building before a batch's prefill is the prefill's. A padded pass's figures then price a
token of each phase (``padded`` puts them in ``extra``), and ``same_mix_cpu_s`` prices the
engine's computed tokens at those costs: the engine skips padding and cached prefixes, so far
more of its computed tokens are decode tokens (each a whole forward's worth of per-row work) than
of a padded pass's, and CPU per computed token averaged over different mixes compares the mixes,
not the cost of a token.

Invariant: the two phases' CPU seconds sum to the CPU of the block (``process_time``), and their
positions to every position the model's forwards ran on inside it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from hybridkv.engine.random_models import build_random

PREFILL, DECODE = "prefill", "decode"

Result = tuple[list[list[int]], int, dict[str, Any]]
"""A pass: every request's new tokens, the positions its forwards computed, and what else it reports."""


class PhaseClock:
    def __init__(self) -> None:
        self.positions = {PREFILL: 0, DECODE: 0}
        self.cpu_s = {PREFILL: 0.0, DECODE: 0.0}
        self._phase = PREFILL
        self._since = 0.0

    @property
    def computed(self) -> int:
        return self.positions[PREFILL] + self.positions[DECODE]

    @contextlib.contextmanager
    def counting(self, model: torch.nn.Module) -> Iterator[PhaseClock]:
        """Count ``model``'s forwards inside the block (its CPU until the first forward is the prefill's)."""
        handle = model.register_forward_pre_hook(self._forward, with_kwargs=True)
        self._phase, self._since = PREFILL, time.process_time()
        try:
            yield self
        finally:
            handle.remove()
            self._switch(self._phase)

    def _forward(self, _: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"][..., 0]
        phase = DECODE if ids.shape[-1] == 1 else PREFILL
        if phase != self._phase:
            self._switch(phase)
        self.positions[phase] += int(ids.numel())

    def _switch(self, phase: str) -> None:
        now = time.process_time()
        self.cpu_s[self._phase] += now - self._since
        self._phase, self._since = phase, now

    def report(self) -> dict[str, Any]:
        """Per phase: CPU seconds, positions, CPU µs per position (None for a phase that did not run)."""
        return {
            "phase_cpu_s": {k: round(v, 4) for k, v in self.cpu_s.items()},
            "phase_positions": dict(self.positions),
            "cpu_us_per_phase_position": {
                k: round(1e6 * self.cpu_s[k] / n, 1) if n else None for k, n in self.positions.items()
            },
        }


def same_mix_cpu_s(prefill_tokens: int, decode_tokens: int, padded_extra: dict[str, Any]) -> float:
    """CPU seconds a padded pass (its ``extra``: ``PhaseClock.report``) spends per phase, applied to ``prefill_tokens``
    and ``decode_tokens`` computed tokens: what those tokens cost in transformers' batched forward."""
    cpu, positions = padded_extra["phase_cpu_s"], padded_extra["phase_positions"]
    total = 0.0
    for phase, tokens in ((PREFILL, prefill_tokens), (DECODE, decode_tokens)):
        if tokens:
            if not positions[phase]:
                raise ValueError(f"the padded pass ran no {phase} forward: it cannot price {tokens} {phase} tokens")
            total += tokens * cpu[phase] / positions[phase]
    return total


def fast_attention(name: str, widen: int = 1) -> tuple[Any, str]:
    """The tiny model ``name`` (widths times ``widen``) with sdpa attention where ``transformers`` supports it for the
    model, else eager."""
    model, _ = build_random(name, widen)
    if getattr(model, "_supports_sdpa", False):
        model.set_attn_implementation("sdpa")
        return model, "sdpa"
    return model, "eager"


def one_by_one(model: Any, prompts: list[list[int]], new: int) -> Result:
    outs = []
    with torch.no_grad(), PhaseClock().counting(model) as clock:
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None)
            outs.append(out[0, len(ids) :].tolist())
    return outs, clock.computed, {}


def padded(model: Any, prompts: list[list[int]], new: int, batch: int, pad: int) -> Result:
    outs = []
    with torch.no_grad(), PhaseClock().counting(model) as clock:
        for start in range(0, len(prompts), batch):
            group = prompts[start : start + batch]
            width = max(map(len, group))
            ids = torch.full((len(group), width), pad, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, p in enumerate(group):
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=pad
            )
            outs += out[:, width:].tolist()
    return outs, clock.computed, clock.report()


def continuous(model: Any, prompts: list[list[int]], new: int, pad: int, step_tokens: int) -> Result:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=pad)
    paged = ContinuousBatchingConfig(page_size=16, num_blocks=1024, max_batch_tokens=step_tokens, use_cuda_graph=False)
    notes = logging.getLogger("ContinuousBatchingLogger")  # its own logger: warnings about psutil, disabled EOS
    level = notes.level
    notes.setLevel(logging.CRITICAL)
    try:
        with torch.no_grad(), PhaseClock().counting(model) as clock:
            results = model.generate_batch(prompts, gen, paged, progress_bar=False, warmup=False)
    finally:
        notes.setLevel(level)
    by_index = {int(k.rpartition("_")[2]): list(v.generated_tokens) for k, v in results.items()}
    return [by_index[i] for i in range(len(prompts))], clock.computed, {}
