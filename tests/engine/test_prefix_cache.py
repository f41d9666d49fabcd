"""Engine prefix caching: hits skip computation on every component and stay token-exact against transformers.

Requests share long prefixes: later ones start at the cache's hit (full KV, sliding windows,
recurrent-state checkpoints, per what each model has), including hits that end inside what
would have been a prefill chunk. Greedy tokens equal ``generate``'s; every sampled position's
logits are within ``ATOL`` of the HF forward (``tests/engine/test_exact.py``'s tolerance).
The memory and the cache tree are checked after every request (and before every step in one
run); once the cache is cleared nothing is live.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridkv.engine.sched.scheduler as scheduler_module
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.sched.request import Outcome, SamplingParams
from hybridkv.engine.sched.scheduler import shared_prefix
from tests.devices import device, no_host_sync, sampling_may_sync
from tests.engine.harness import hf_model, hf_reference, live_counts, prompt
from tests.engine.test_exact import ATOL

ALL_MODELS = ["tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-next", "tiny-nemotron-h", "tiny-kimi-linear"]
HAS_WINDOW = {"tiny-gemma3", "tiny-gpt-oss"}
HAS_STATE = {"tiny-qwen3-next", "tiny-nemotron-h", "tiny-kimi-linear"}
CHUNK = 7
SHARED = prompt(900, 45)
FIRST = SHARED + prompt(901, 6)
LATER = [SHARED + prompt(910 + i, 3 + 2 * i) for i in range(4)]


def _engine(name: str, budget: int, page_size: int, **kw: Any) -> Engine:
    hf = hf_model(name)
    return Engine(
        hf.config, hf, EngineConfig(gpu_memory=budget, page_size=page_size, chunk_size=CHUNK, max_context=96, **kw)
    )


class Logits:
    """Records the logits of every sampled position, keyed by (request index, tokens so far)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.rows: dict[tuple[int, int], torch.Tensor] = {}
        choose = scheduler_module.choose_tokens

        def recording(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
            for row, p, pos in zip(logits, params, positions, strict=True):
                self.rows[(p.seed, pos)] = row.clone()
            return choose(logits, params, positions)

        monkeypatch.setattr(scheduler_module, "choose_tokens", recording)

    def check(self, name: str, index: int, ids: list[int], out: Outcome, max_new: int) -> None:
        tokens, ref = hf_reference(name, tuple(ids), max_new)
        assert out.error is None, out.error
        assert out.output_ids == tokens, f"request {index}: prompt of {len(ids)} tokens"
        for k in range(len(out.output_ids)):
            diff = float((self.rows[(index, len(ids) + k)] - ref[k]).abs().max())
            assert diff < ATOL, f"request {index}, token {k}: logits differ by {diff}"


def _checked(engine: Engine) -> Any:
    def after(index: int, out: Outcome) -> None:
        engine.mem.verify()
        engine.cache.check()

    return after


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_shared_prefixes_hit_every_component_and_stay_exact(
    name: str, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(name, 2_000_000, page_size)
    empty = live_counts(engine.mem)
    logits = Logits(monkeypatch)
    first = engine.generate([FIRST], 6, on_output=_checked(engine))
    assert first[0].cached_tokens == 0
    logits.check(name, 0, FIRST, first[0], 6)
    # the first later request checkpoints where the shared prefix ends (its checkpoint_at); the others hit there
    outs: list[Outcome] = []
    for part in (LATER[:1], LATER[1:]):
        logits.rows.clear()
        done = engine.generate(part, 6, on_output=_checked(engine))
        for i, (ids, out) in enumerate(zip(part, done, strict=True)):
            logits.check(name, i, ids, out, 6)
        outs += done
    for out in outs:
        hit = out.hit
        assert hit is not None and hit.full >= max(hit.cached_tokens, 45 // page_size * page_size - page_size)
    # the first later request may find no checkpoint on its full-KV match (none at a page-aligned chunk end)
    for out in outs[1:]:
        hit = out.hit
        assert hit is not None and out.cached_tokens == hit.cached_tokens > 0
        if name in HAS_WINDOW:
            assert hit.window > 0  # the window component itself hit (issue 8: hits > 0 on every component)
        if name in HAS_STATE:
            assert hit.checkpoint == hit.cached_tokens
    assert any(o.cached_tokens % CHUNK for o in outs), [o.cached_tokens for o in outs]  # a hit that ends mid-chunk
    assert engine.stats["forward_tokens"] < sum(map(len, [FIRST, *LATER])) + 6 * 5  # hits were not recomputed
    engine.clear_cache()
    engine.mem.verify()
    engine.cache.check()
    assert live_counts(engine.mem) == empty


@pytest.mark.parametrize("name", sorted(HAS_STATE))
def test_chunk_checkpoints_are_written_by_the_forward(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk that ends where the placement wants a checkpoint has its slot reserved before the step
    (one allocation for the step) and the forward writes the state there with the running state: no checkpoint
    is copied after a step, and later requests that hit those checkpoints stay exact."""
    from hybridkv.cache.request_checkpoints import Checkpoints

    copies: list[int] = []
    reserved: list[int] = []
    checkpoint, reserve = Checkpoints.take, Checkpoints.reserve_step
    monkeypatch.setattr(Checkpoints, "take", lambda self, h: copies.append(1) or checkpoint(self, h))
    monkeypatch.setattr(
        Checkpoints, "reserve_step", lambda self, hs, ats: reserved.append(len(hs)) or reserve(self, hs, ats)
    )
    engine = _engine(name, 2_000_000, 4)
    logits = Logits(monkeypatch)
    engine.generate([FIRST], 6, on_output=_checked(engine))
    done = engine.generate(LATER[:3], 6, on_output=_checked(engine))
    for i, (ids, out) in enumerate(zip(LATER[:3], done, strict=True)):
        logits.check(name, i, ids, out, 6)
    assert sum(reserved) > 0 and not copies
    assert any(o.hit is not None and o.hit.checkpoint > 0 for o in done)


@pytest.mark.parametrize("name", sorted(HAS_WINDOW))
def test_a_hit_inside_the_span_that_left_the_window_is_kept_and_exact(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode pages that left the first request's window stay window-cached until its finish
    inserts them: a later request whose hit ends among them (far behind the first one's final
    window) hits on every component and stays exact."""
    engine = _engine(name, 2_000_000, 4)
    logits = Logits(monkeypatch)
    first = prompt(920, 12)
    done = engine.generate([first], 40, on_output=_checked(engine))[0]
    later = first + done.output_ids[:21] + prompt(921, 5)  # the hit ends at 32, the first request at 52
    out = engine.generate([later], 4, on_output=_checked(engine))[0]
    logits.check(name, 0, later, out, 4)
    assert out.hit is not None and out.cached_tokens == out.hit.window == out.hit.full == 32
    engine.clear_cache()
    engine.mem.verify()
    engine.cache.check()


def test_a_hit_inside_one_chunk_starts_prefill_at_the_hit() -> None:
    """The second request's hit (page-aligned, 44 with pages of 4) is not a multiple of the chunk (7):
    its prefill starts at 44, so the engine computes only its 7 - 1 new prompt tokens + the decodes."""
    engine = _engine("tiny-qwen3-next", 2_000_000, 4)
    engine.generate([[*SHARED, 5]], 1)
    before = engine.stats["forward_tokens"]
    ids = SHARED + prompt(77, 7)
    out = engine.generate([ids], 4)[0]
    assert out.cached_tokens == 44 and 44 % CHUNK
    assert engine.stats["forward_tokens"] - before == len(ids) - 44 + 3
    assert out.output_ids == hf_reference("tiny-qwen3-next", tuple(ids), 4)[0]


@pytest.mark.parametrize("name", sorted(HAS_STATE))
def test_a_branch_checkpoint_inside_a_chunk_is_hit_exactly(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Placement ``branch`` only: the first request caches its KV without any checkpoint; the
    second shares 45 tokens with it, so its match is cut at the branch p = 44 (pages of 4), which
    lies inside a prefill chunk (chunks of 7): prefill ends a chunk at 44 and stores the state
    there. The third hits exactly there, on the state component, and every output equals
    transformers'. Without a placement nothing is stored and the third computes everything."""
    p = 44
    third = SHARED + prompt(920, 5)
    for placement, hit in (("branch", p), ("none", 0)):
        engine = _engine(name, 2_000_000, 4, checkpoints=placement)
        logits = Logits(monkeypatch)
        first, second = engine.generate([FIRST], 3)[0], engine.generate([LATER[0]], 3)[0]
        assert first.cached_tokens == second.cached_tokens == 0
        assert second.hit is not None and second.hit.full == p and p % CHUNK
        logits.rows.clear()
        out = engine.generate([third], 4, on_output=_checked(engine))[0]
        assert out.hit is not None and (out.cached_tokens, out.hit.checkpoint, out.hit.full) == (hit, hit, p)
        logits.check(name, 0, third, out, 4)
        assert second.output_ids == hf_reference(name, tuple(LATER[0]), 3)[0]
        engine.clear_cache()
        engine.mem.verify()


def test_without_the_prefix_cache_nothing_is_cached() -> None:
    engine = _engine("tiny-gemma3", 2_000_000, 4, prefix_cache=False)
    engine.generate([FIRST], 4)
    outs = engine.generate(LATER, 4)
    assert [o.cached_tokens for o in outs] == [0] * len(LATER)
    assert engine.cache.cached_tokens == 0
    assert [o.output_ids for o in outs] == [hf_reference("tiny-gemma3", tuple(p), 4)[0] for p in LATER]


def test_cache_salts_keep_namespaces_apart() -> None:
    engine = _engine("tiny-gpt-oss", 2_000_000, 4)
    engine.generate([FIRST], 2, cache_salts=["a"])
    outs = engine.generate(LATER[:2], 2, cache_salts=["b", "a"])
    assert outs[0].cached_tokens == 0 and outs[1].cached_tokens > 0
    assert [o.output_ids for o in outs] == [hf_reference("tiny-gpt-oss", tuple(p), 2)[0] for p in LATER[:2]]
    with pytest.raises(ValueError, match="1 cache salts for 2 prompts"):
        engine.generate(LATER[:2], 2, cache_salts=["a"])


@pytest.mark.parametrize("name", ALL_MODELS)
def test_a_prompt_sharing_a_running_prefill_waits_for_it_and_others_pass(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three prompts arrive together in a step budget that holds them all: the second shares 45 tokens with
    the first, the third nothing. The second waits until the first computed the shared prefix (the third is
    admitted in the first step, past it), then starts from the cache: the shared tokens are computed once.
    With another cache salt it cannot reuse them, so it does not wait. All exact."""
    unrelated = prompt(930, 20)
    for salt, waits in (("a", True), ("b", False)):
        engine = _engine(name, 2_000_000, 4, max_step_tokens=200)
        logits = Logits(monkeypatch)
        rids = [engine.submit(FIRST, SamplingParams(max_new_tokens=4), cache_salt="a")]
        rids.append(engine.submit(LATER[0], SamplingParams(max_new_tokens=4), cache_salt=salt))
        rids.append(engine.submit(unrelated, SamplingParams(max_new_tokens=4), cache_salt="a"))
        engine.step()
        assert [r.rid for r in engine.sched.waiting] == ([rids[1]] if waits else [])
        assert {r.rid for r in engine.sched.running} == set(rids) - {r.rid for r in engine.sched.waiting}
        outs: dict[int, Outcome] = {}
        while engine.has_work():
            for out in engine.step().finished:
                outs[out.rid] = out
        second = outs[rids[1]]
        assert (second.cached_tokens > 0) == waits
        assert (engine.metrics()["prefix_waits"] > 0) == waits  # /metrics: hybridkv_prefix_waits_total
        if name in HAS_WINDOW:  # the page-aligned shared prefix; recurrent models hit a checkpoint in it
            assert second.cached_tokens == (44 if waits else 0)
        prompts = [FIRST, LATER[0], unrelated]
        assert engine.stats["forward_tokens"] == sum(map(len, prompts)) - second.cached_tokens + 3 * 3
        for index, (ids, rid) in enumerate(zip(prompts, rids, strict=True)):
            logits.check(name, rid, ids, outs[rid], 4)
            assert index == rid
        engine.mem.verify()
        engine.cache.check()


@pytest.mark.parametrize("name", sorted(HAS_STATE))
def test_a_prompt_branching_off_a_running_prefill_gets_its_branch_checkpoint_and_hits_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No interval checkpoints: the first request (51 tokens) would store its state only at its prompt's end.
    The second shares 45 tokens with it and arrives in the same step: the first is given a checkpoint where the
    second branches off (44, pages of 4), so the second waits, then hits exactly there, and both end exact.
    A placement without ``branch`` stores nothing there: the second is admitted at once and computes it all."""
    for placement, hit in (("prompt-aligned,branch,end", 44), ("prompt-aligned,end", 0)):
        engine = _engine(name, 2_000_000, 4, max_step_tokens=200, checkpoints=placement)
        logits = Logits(monkeypatch)
        rids = [engine.submit(p, SamplingParams(max_new_tokens=4)) for p in (FIRST, LATER[0])]
        engine.step()
        assert [r.rid for r in engine.sched.waiting] == ([rids[1]] if hit else [])
        first = engine.sched.requests[rids[0]]
        assert first.wanted[:1] == ((44,) if hit else (48,))  # the branch point, then the prompt's end
        outs: dict[int, Outcome] = {}
        while engine.has_work():
            for out in engine.step().finished:
                outs[out.rid] = out
        second = outs[rids[1]]
        assert second.cached_tokens == hit and (second.hit is not None and second.hit.checkpoint == hit)
        assert engine.stats["forward_tokens"] == len(FIRST) + len(LATER[0]) - hit + 2 * 3
        for ids, rid in zip((FIRST, LATER[0]), rids, strict=True):
            logits.check(name, rid, ids, outs[rid], 4)
        engine.mem.verify()
        engine.cache.check()


@given(
    st.lists(st.integers(0, 3), max_size=300),
    st.lists(st.integers(0, 3), max_size=300),
    st.integers(0, 320),
)
def test_shared_prefix_counts_the_leading_equal_tokens(a: list[int], b: list[int], limit: int) -> None:
    common = 0
    while common < min(len(a), len(b), limit) and a[common] == b[common]:
        common += 1
    assert shared_prefix(a, b, limit) == common
    assert shared_prefix(a, a + b, limit) == min(len(a), limit)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-gemma3"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_requests_arriving_at_random_steps_in_prefix_families_end_exact_and_keep_the_books(
    name: str, data: st.DataObject
) -> None:
    """Prompts of a few prefix families arrive at random steps into random step budgets and page sizes, so that
    some wait for a running prefill of their prefix and others pass them: the memory and the tree hold after
    every step, every request ends within a bounded number of steps (none waits forever) with transformers'
    greedy tokens, and nothing is live once the cache is cleared."""
    heads = [prompt(500 + f, data.draw(st.integers(4, 40), "head")) for f in range(data.draw(st.integers(1, 3)))]
    prompts = [
        heads[data.draw(st.integers(0, len(heads) - 1), "family")] + prompt(600 + i, data.draw(st.integers(1, 12)))
        for i in range(data.draw(st.integers(2, 7), "requests"))
    ]
    arrivals = [data.draw(st.integers(0, 4), "arrival step") for _ in prompts]
    page = data.draw(st.sampled_from([1, 4, 16]), "page size")
    engine = _engine(name, 2_000_000, page, max_step_tokens=data.draw(st.sampled_from([8, 20, 200]), "budget"))
    empty = live_counts(engine.mem)
    rids: dict[int, int] = {}
    outs: dict[int, Outcome] = {}
    for step in range(200):
        for i, at in enumerate(arrivals):
            if at == step:
                rids[engine.submit(prompts[i], SamplingParams(max_new_tokens=3))] = i
        for out in engine.step().finished:
            outs[rids[out.rid]] = out
        engine.mem.verify()
        engine.cache.check()
        if len(outs) == len(prompts):
            break
    assert len(outs) == len(prompts), f"{len(prompts) - len(outs)} requests still open after 200 steps"
    for i, ids in enumerate(prompts):
        assert outs[i].error is None and outs[i].output_ids == hf_reference(name, tuple(ids), 3)[0], i
    engine.clear_cache()
    assert live_counts(engine.mem) == empty


GROUPS = [prompt(300 + g, 20 + 6 * g) for g in range(4)]
MIXED = [GROUPS[i % 4] + prompt(400 + i, 1 + (5 * i) % 17) for i in range(18)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_a_small_budget_retracts_and_evicts_and_stays_exact(
    name: str, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """18 requests of mixed lengths in 4 prefix groups, one bad request among them: the cache evicts
    to make room, requests are retracted (and resume from what they cached); all exact. (At such a
    budget the cache mostly thrashes; hits are proven above.) Nemotron-H's large state slots admit
    few requests at once below 200 KB, too few to run out of memory; Kimi-Linear's requests that wait for a
    running prefill of their prefix leave room at 150 KB. Checkpoints every 8 tokens
    (every page of 16) take state slots from the same budget: prefill chunks end there too."""
    placement = f"interval:{max(8, page_size)},prompt-aligned,branch,end"
    budget = {"tiny-nemotron-h": 200_000, "tiny-kimi-linear": 110_000}.get(name, 150_000)
    engine = _engine(name, budget, page_size, checkpoints=placement, max_step_tokens=4 * CHUNK)
    empty = live_counts(engine.mem)
    logits = Logits(monkeypatch)
    batch = [*MIXED[:5], [], *MIXED[5:9], [3, 999], *MIXED[9:]]
    outs = engine.generate(batch, 8, on_output=_checked(engine))
    assert engine.stats["retractions"] > 0
    assert engine.cache.stats()["evicted_pages"] > 0  # type: ignore[operator]
    assert "empty prompt" in (outs[5].error or "") and "outside the vocabulary" in (outs[10].error or "")
    good = [i for i in range(len(batch)) if i not in (5, 10)]
    for i in good:
        logits.check(name, i, batch[i], outs[i], 8)
    engine.clear_cache()
    engine.mem.verify()
    engine.cache.check()
    assert live_counts(engine.mem) == empty


def test_memory_and_cache_hold_before_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine("tiny-qwen3-next", 150_000, 4, max_step_tokens=4 * CHUNK)
    forward = engine.runner.forward
    steps = []

    def checked(batch: Any) -> torch.Tensor:
        engine.mem.verify()
        engine.cache.check()
        steps.append(1)
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", checked)
    outs = engine.generate(MIXED, 6)
    assert len(steps) == engine.stats["steps"] and engine.stats["retractions"] > 0
    assert [o.output_ids for o in outs] == [hf_reference("tiny-qwen3-next", tuple(p), 6)[0] for p in MIXED]


@pytest.mark.host_sync
@pytest.mark.parametrize("name", ALL_MODELS)
def test_no_host_sync_in_the_cached_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Matching, admitting, forking checkpoints, inserting, evicting and releasing read nothing back
    from the device: the only host read is the sampled tokens (one ``tolist`` a step)."""
    engine = _engine(name, 300_000, 4, device=device())
    engine.generate(MIXED[:4], 2)  # the group prefixes, cached
    sampling_may_sync(monkeypatch)
    with no_host_sync() as counter:
        engine.generate(MIXED, 6)
    assert engine.stats["cached_tokens"] > 0 and engine.cache.stats()["evicted_pages"] > 0
    assert set(counter.counts) == {"tolist"}
    assert counter.counts["tolist"] <= engine.stats["steps"]
