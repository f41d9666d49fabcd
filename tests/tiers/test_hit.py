"""The cross-tier hit rule: the longest prefix where every component is restorable from some
tier, by the device's own per-kind rules. Checked against a brute-force oracle, and, with
device-only residency, against the prefix cache's own hit on random trees."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache import PAGE_NEED, HybridRadixCache, KVManager
from hybridkv.spec import WindowPool
from hybridkv.tiers import Residency, Where, cross_tier_hit, device_view
from tests.cache.helpers import small_memory

CODES = st.sampled_from(list(Where))


def oracle(res: Residency, ps: int, windows: list[WindowPool], upto: int) -> int:
    """Try every end from the longest down; the first valid one, by the rules' words."""
    for e in range(upto, 0, -1):
        if any(res.full[i] == Where.NOWHERE for i in range(e)):
            continue
        if res.checkpoints is not None and res.checkpoints[e] == Where.NOWHERE:
            continue
        ok = True
        for pool, where in zip(windows, res.windows, strict=True):
            first = max(0, e * ps - pool.window) // ps
            ok &= all(where[i] != Where.NOWHERE for i in range(first, e))
        if ok:
            return e
    return 0


@st.composite
def residencies(draw: st.DrawFn) -> tuple[Residency, int, list[WindowPool], int]:
    n = draw(st.integers(0, 24))
    ps = draw(st.sampled_from([1, 2, 4]))
    windows = [WindowPool(w) for w in draw(st.lists(st.integers(1, 20), max_size=2, unique=True))]

    def arr(size: int) -> np.ndarray:
        return np.asarray(draw(st.lists(CODES, min_size=size, max_size=size)), dtype=np.int8)

    ckpts = arr(n + 1) if draw(st.booleans()) else None
    res = Residency(arr(n), tuple(arr(n) for _ in windows), ckpts)
    return res, ps, windows, draw(st.integers(0, n))


@given(residencies())
def test_longest_valid_prefix_matches_the_oracle(case):
    res, ps, windows, upto = case
    hit = cross_tier_hit(res, ps, windows, upto)
    assert hit.pages == oracle(res, ps, windows, upto)
    e = hit.pages
    assert (hit.full == res.full[:e]).all() and (hit.full != Where.NOWHERE).all()
    for pool, (first, where), full in zip(windows, hit.windows, res.windows, strict=True):
        assert first == (max(0, e * ps - pool.window) // ps if e else 0)
        assert (where == full[first:e]).all() and (where != Where.NOWHERE).all()
    if res.checkpoints is not None and e:
        assert hit.checkpoint == res.checkpoints[e] != Where.NOWHERE
    assert sum(hit.full_tokens().values()) == hit.tokens


@given(residencies())
def test_a_tier_gaining_a_piece_never_shortens_the_hit(case):
    res, ps, windows, upto = case
    before = cross_tier_hit(res, ps, windows, upto).pages
    better = Residency(
        np.minimum(res.full, Where.STORE),
        res.windows,
        None if res.checkpoints is None else np.minimum(res.checkpoints, Where.STORE),
    )
    assert cross_tier_hit(better, ps, windows, upto).pages >= before


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("serve"), st.integers(0, 3), st.integers(4, 40), st.integers(0, 2)),
        st.tuples(st.just("evict"), st.sampled_from(["pages", "window", "state"]), st.integers(1, 6)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60)
@given(st.sampled_from(["tiny-swa2-state", "tiny-gdn", "tiny-swa", "tiny-dense"]), OPS, st.integers(0, 2**31))
def test_device_only_residency_gives_the_device_hit(preset, ops, seed):
    """With every piece only on the device, the cross-tier rule answers exactly what the
    prefix cache's ``match_prefix`` answers, on trees shaped by serving and evicting."""
    mem = small_memory(preset)
    cache = HybridRadixCache(mem)
    kvm = KVManager(cache, "interval:8,branch")
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 5, 48) for _ in range(4)]
    windows = [w.pool_id for w in cache.rules.windows]
    queries = []
    for op in ops:
        if op[0] == "serve":
            _, stem, length, tail = op
            tokens = np.concatenate([stems[stem][:length], rng.integers(5, 9, tail)])
            queries.append(tokens)
            match = kvm.match(tokens[:-1])
            kv = kvm.admit(match)
            for at in kvm.checkpoints.wanted(kv, tokens.size):
                kvm.checkpoints.reserve(kv, at)
            kvm.extend(kv, tokens.size)
            kvm.release_windows([kv])
            kvm.finish(kv, tokens)
        else:
            _, what, count = op
            pool = {"pages": PAGE_NEED, "window": windows[0] if windows else PAGE_NEED}.get(what)
            if what == "state":
                pool = cache.rules.checkpoint.pool_id if cache.rules.checkpoint is not None else PAGE_NEED
            cache.evict({pool: count})
        for q in [*queries[-3:], stems[0][:30]]:
            dev = device_view(cache, q)
            n, nd = q.size // cache.page_size, dev.pages.size
            full = np.full(n, Where.NOWHERE, dtype=np.int8)
            full[:nd] = Where.DEVICE
            wins = []
            for resident in dev.window_resident:
                w = np.full(n, Where.NOWHERE, dtype=np.int8)
                w[:nd][resident] = Where.DEVICE
                wins.append(w)
            ckpts = None
            if cache.rules.checkpoint is not None:
                ckpts = np.full(n + 1, Where.NOWHERE, dtype=np.int8)
                ckpts[list(dev.checkpoints)] = Where.DEVICE
            hit = cross_tier_hit(Residency(full, tuple(wins), ckpts), cache.page_size, windows)
            assert hit.tokens == cache.match_prefix(q).length
        cache.check()
