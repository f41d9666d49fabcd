"""The ranks of one engine agree on a hit restored from their tiers: a rank that holds less below, or
whose object turns out damaged at the copy, brings every rank back to what all can restore, at the
same length, and every rank computes the rest: tokens exact, nothing held, never a hang.

Two engines stand for two ranks (replicas of one layout, each with its own host memory), their
schedulers joined by ``Joined``: an ``Agreement`` whose ``min`` meets the other rank's at a barrier
(``WorldAgreement``'s semantics in one process, with a timeout: a rank that makes a call the other
does not make fails the test instead of hanging it). The multi-process version of the same protocol
runs in ``test_disagg_tiers.py`` (a PP 2 prefill engine over host memory and the Mooncake Store).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence

import numpy as np

from hybridkv.engine.engine import Engine
from hybridkv.engine.sched.agreement import Agreement
from hybridkv.engine.sched.request import Outcome
from hybridkv.tiers.framing import HEADER
from tests.engine.harness import hf_reference, live_counts
from tests.engine.test_tiers import NEW, A, engine, turn

NAME = "tiny-qwen3-next"


class Joined:
    """``n`` ranks' ``min`` calls, met at a barrier (60 s: a divergent schedule fails, never hangs)."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=60)
        self.values: list[list[int]] = [[] for _ in range(n)]
        self.calls = 0

    def rank(self, r: int) -> Agreement:
        joined = self

        class Member:
            barrier = joined.barrier

            def min(self, values: Sequence[int]) -> list[int]:
                joined.values[r] = [int(v) for v in values]
                joined.barrier.wait()
                sizes = {len(v) for v in joined.values}
                out = [min(col) for col in zip(*joined.values, strict=False)]
                if r == 0:
                    joined.calls += 1
                joined.barrier.wait()
                assert len(sizes) == 1, f"the ranks made different agreement calls: {joined.values}"
                return out

        return Member()


def ranks(**tiers: object) -> list[Engine]:
    engines = [engine(NAME, **tiers) for _ in range(2)]
    joined = Joined(2)
    for r, e in enumerate(engines):
        e.sched.agree = joined.rank(r)
    return engines


def together(engines: list[Engine], ids: list[int], salt: str) -> list[Outcome]:
    """Every rank serves ``ids`` at once (each in its thread); their outputs, exact."""
    outs: list[Outcome | BaseException | None] = [None] * len(engines)

    def serve(r: int) -> Callable[[], None]:
        def run() -> None:
            try:
                outs[r] = engines[r].generate([ids], NEW, cache_salts=[salt])[0]
            except BaseException as exc:  # re-raised below, in the test's thread
                outs[r] = exc
                engines[r].sched.agree.barrier.abort()  # type: ignore[attr-defined]  # the other rank stops waiting

        return run

    threads = [threading.Thread(target=serve(r)) for r in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for out in outs:
        if isinstance(out, BaseException):
            raise out
    done = [o for o in outs if isinstance(o, Outcome)]
    want = hf_reference(NAME, tuple(ids), NEW)[0]
    assert [o.output_ids for o in done] == [want] * len(engines)
    return done


def test_a_rank_with_less_below_brings_every_rank_to_the_hit_all_can_restore() -> None:
    engines = ranks(host_memory="8MiB")
    salt = uuid.uuid4().hex
    empty = [live_counts(e.mem) for e in engines]
    together(engines, A, salt)
    for e in engines:
        e.clear_cache()  # device -> host memory on both ranks
    both = together(engines, turn(1), salt)
    assert [o.cached_tokens_details for o in both] == [{"device": 0, "host": 40, "storage": 0}] * 2
    for e in engines:
        e.clear_cache()
    rank1 = engines[1].tiers
    assert rank1 is not None and rank1.hierarchy.host is not None
    rank1.hierarchy.host.clear()  # rank 1's host memory emptied (no store below): only rank 0 could restore
    neither = together(engines, turn(2), salt)
    assert [o.cached_tokens for o in neither] == [0, 0]
    for e, before in zip(engines, empty, strict=True):
        e.clear_cache()
        assert live_counts(e.mem) == before
        e.mem.verify()
        e.cache.check()


def test_a_damaged_object_on_one_rank_makes_every_rank_fall_back() -> None:
    engines = ranks(host_memory="8MiB")
    salt = uuid.uuid4().hex
    together(engines, A, salt)
    for e in engines:
        e.clear_cache()
    h = engines[1].tiers.hierarchy  # type: ignore[union-attr]
    assert h.host is not None
    pool = h.full_pools[0]
    key = h.keys.keys(pool, h.keys.page_names(np.asarray(A[:4]), salt))[0]
    frame = h.host._read([key], [HEADER + h.keys.payload_bytes[pool]])[0]  # rank 1's own frame of page 0
    assert not isinstance(frame, Exception)
    frame[HEADER + 5] ^= 0x40  # the plan still sees it; its checksum fails at the copy
    outs = together(engines, turn(1), salt)
    assert [o.cached_tokens for o in outs] == [0, 0]  # both recomputed: rank 0's good copy was dropped too
    t0, t1 = engines[0].tiers, engines[1].tiers
    assert t0 is not None and t1 is not None
    assert t1.hierarchy.counters.misses == {"checksum": 1} and t1.hierarchy.counters.fallbacks == 1
    assert t0.fallbacks["peer"] == 1 and not t0.hierarchy.counters.misses
    for e in engines:
        assert e.tiers is not None and e.tiers.hierarchy.counters.restored_requests == 0
        e.mem.verify()
        e.cache.check()
