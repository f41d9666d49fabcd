"""Test harness: serve requests through ShardRunner with the memory API directly, and HF references."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from hybridkv.engine.forward.batch import ForwardBatch
from hybridkv.engine.random_models import build_random
from hybridkv.engine.registry import engine_spec
from hybridkv.engine.runner import ShardRunner
from hybridkv.engine.sched.kv import Admission, Budget, RequestKV
from hybridkv.engine.sched.request import Request, SamplingParams
from hybridkv.engine.weights import from_hf_model
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import ShardSpec


@cache
def hf_model(name: str) -> Any:
    model, _ = build_random(name)
    return model


def prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


@cache
def hf_reference(name: str, ids: tuple[int, ...], max_new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of ``generate`` (stopping at EOS) and the logits after the prompt and each new token."""
    model = hf_model(name)
    inp = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(inp, max_new_tokens=max_new, do_sample=False)
        full = model(out).logits[0]
    tokens = out[0, len(ids) :].tolist()
    return tokens, full[len(ids) - 1 :]


def make_runner(name: str, page_size: int, budget: int = 4_000_000, max_context: int = 256) -> ShardRunner:
    model = hf_model(name)
    spec = engine_spec(model.config, torch.float32, name=name)
    mem = UnifiedMemory.create(
        ShardSpec.whole(spec), budget, page_size=page_size, max_context=max_context, chunk_tokens=64
    )
    return ShardRunner(from_hf_model(model), mem)


@dataclass
class Served:
    tokens: list[int]
    logits: list[torch.Tensor]  # last-position logits after the prompt and after each decoded token


def serve(
    runner: ShardRunner, prompts: list[list[int]], chunk: int, max_new: int, compact: bool = False
) -> list[Served]:
    """Chunked prefill of every prompt, then greedy decode; all requests batched in every step.

    ``compact``: defragment the memory between steps (cells move; virtual ids stay).
    """
    kv = RequestKV(runner.mem, prefix_cache=False)
    reqs = [admitted(kv, ids, chunk) for ids in prompts]
    out = [Served([], []) for _ in prompts]
    fed = [0] * len(prompts)
    pending: list[int | None] = [None] * len(prompts)
    while any(len(o.tokens) < max_new for o in out):
        active, new_ids = [], []
        for i, p in enumerate(prompts):
            if fed[i] < len(p):
                new_ids.append(p[fed[i] : fed[i] + chunk])
            elif len(out[i].tokens) < max_new and pending[i] is not None:
                new_ids.append([pending[i]])
            else:
                continue
            active.append(i)
        step_reqs: list[Request] = [reqs[i] for i in active]
        prefix = [r.computed for r in step_reqs]
        spans = [len(x) for x in new_ids]
        kv.allocate(step_reqs, spans)
        batch = ForwardBatch.build(
            new_ids,
            prefix,
            [locs(r) for r in step_reqs],
            [slot(r) for r in step_reqs] if kv.has_state else None,
            [r.fresh for r in step_reqs] if kv.has_state else None,
        )
        logits = runner.forward(batch)
        computed(kv, step_reqs, spans)
        if compact:
            runner.mem.compact()
        for row, i in enumerate(active):
            fed[i] += len(new_ids[row]) if fed[i] < len(prompts[i]) else 0
            if fed[i] >= len(prompts[i]):
                tok = int(torch.argmax(logits[row]))
                out[i].logits.append(logits[row])
                out[i].tokens.append(tok)
                pending[i] = tok
    runner.mem.verify()
    kv.free(*reqs, cache=False)
    runner.mem.verify()
    return out


def admitted(kv: RequestKV, ids: list[int], chunk: int) -> Request:
    """A request of ``ids`` admitted alone, its first chunk ``chunk`` tokens (it computes from ``computed``)."""
    req = Request(0, list(ids), SamplingParams())
    assert kv.admit(req, Budget(chunk, alone=True)) is Admission.ADMITTED
    assert req.kv is not None
    req.computed = req.kv.seq_len
    return req


def computed(kv: RequestKV, reqs: list[Request], spans: list[int]) -> None:
    """After a forward of ``spans`` tokens of ``reqs``: tell ``kv``, then advance them (as the scheduler does)."""
    kv.computed(reqs)
    for req, span in zip(reqs, spans, strict=True):
        req.computed += span


def locs(req: Request) -> np.ndarray:
    """Virtual token locations of an admitted request's whole sequence."""
    assert req.kv is not None
    return req.kv.token_locs()


def slot(req: Request) -> int | None:
    """An admitted request's running state slot."""
    assert req.kv is not None
    return req.kv.state_slot


def live_counts(mem: UnifiedMemory) -> tuple[int, int]:
    pages = int(mem.pages.capacity - mem.pages.free_count)
    slots = int(mem.slots.capacity - mem.slots.free_count)
    return pages, slots
