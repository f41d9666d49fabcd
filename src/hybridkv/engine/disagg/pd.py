"""run_pd: serve a fixed list of prompts on a ``PDServer`` and return every request's outcome.

``run_pd(PDConfig(model_dir, prompts, max_new, prefill_pp=2, decode_tp=2))`` starts the server
(layout checked first: nothing starts on a mismatch), submits every prompt at once, waits for
each, stops the server (every worker drains, verifies its memory and reports its live pages and
slots) and returns ``PDResult``: per prompt, in input order, the tokens (``[]`` when failed), the
``RequestTiming`` (``None`` when failed) and the ``Outcome`` (finish reason, error, prefix-cache
hit; its ``PDPath``: status, bytes moved); plus every surviving worker's ``PDRank`` and one line per worker that died.
Every process the server started is gone when it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.engine.disagg.config import PDConfig
from hybridkv.engine.disagg.path import RequestTiming
from hybridkv.engine.disagg.results import PDRank, pd_path
from hybridkv.engine.disagg.server import PDServer
from hybridkv.engine.sched.request import Outcome, SamplingParams


@dataclass(frozen=True)
class PDResult:
    output_ids: list[list[int]]  # per prompt ([] when the request failed)
    ranks: list[PDRank]  # every worker that stopped cleanly
    timings: list[RequestTiming | None]  # per prompt, input order (None when failed)
    requests: list[Outcome]  # per prompt: finish reason, error, cached tokens, its path (status, bytes)
    deaths: list[str]  # one line per worker that died while serving
    pids: list[int]  # every worker process the server started
    shm_files: list[str]  # every decode rank's shared-memory file (all unlinked by then)


def run_pd(
    config: PDConfig, params: SamplingParams | Sequence[SamplingParams] | None = None, *, alone_first: int = 0
) -> PDResult:
    """Serve ``config.prompts`` disaggregated with ``params`` (one for all or one per prompt; default:
    ``config.max_new`` tokens, greedy, ending at EOS): the first ``alone_first`` one at a time (each in
    the prefill prefix cache when the next comes: prompts submitted together are prefilled together,
    so none of them hits another), then the rest at once."""
    if not config.prompts or not all(config.prompts):
        raise ValueError("run_pd needs at least one prompt, each of at least one token")
    each = [params] * len(config.prompts) if params is None or isinstance(params, SamplingParams) else list(params)
    if len(each) != len(config.prompts):
        raise ValueError(f"{len(each)} sampling params for {len(config.prompts)} prompts; give one or one per prompt")
    with PDServer(config) as server:
        results = [server.result(server.submit(config.prompts[i], each[i])) for i in range(alone_first)]
        rest = zip(config.prompts[alone_first:], each[alone_first:], strict=True)
        handles = [server.submit(p, q) for p, q in rest]
        results += [server.result(h) for h in handles]
    return PDResult(
        [r.output_ids for r in results],
        server.ranks,
        [pd_path(r).timing for r in results],
        results,
        server.deaths,
        server.pids(),
        server.shm_paths(),
    )
