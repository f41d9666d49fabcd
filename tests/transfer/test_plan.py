"""Pairing and plans on real and tiny presets, PP 1/2/4 prefill, TP 1/2/4 on both sides,
against the independent expectation in ``expect.py``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import FullAttention, IdSpace, Linear, ModelSpec, Parallel, ShardSpec, StateTensor, get_preset
from hybridkv.testing.pattern import expected_arena, fill, mismatch
from hybridkv.transfer import PlanError, TransferPlan, buffer_set_from_memory, build_plan, memory_cells, pair_entries
from hybridkv.transfer import plan as plan_module
from tests.transfer.expect import expected_atoms, merge_runs

PRE_BASE, DEC_BASE, RANK_STRIDE = 1 << 44, 1 << 40, 1 << 38


def meta_memory(name: str | ModelSpec, pp: int, tp: int, pp_rank: int, tp_rank: int, page_size: int) -> UnifiedMemory:
    model = get_preset(name) if isinstance(name, str) else name
    tiny = model.name.startswith("tiny")
    return UnifiedMemory.create(
        ShardSpec(model, Parallel(tp, pp), pp_rank, tp_rank),
        "2MiB" if tiny else "4GiB",
        device="meta",
        page_size=page_size,
        max_context=64 if tiny else 256,
        chunk_tokens=16 if tiny else 64,
    )


def request(mem: UnifiedMemory, pages: int, skip: int, shuffle: int) -> tuple[np.ndarray, int | None]:
    """Allocate ``pages`` request pages after ``skip`` others, in a scrambled order."""
    mem.alloc_pages(skip)
    got = mem.alloc_pages(pages)
    got = np.random.default_rng(shuffle).permutation(got) if shuffle else got
    slot = None
    if mem.slot_pools:
        mem.alloc_state(skip % 3 + 1)
        slot = int(mem.alloc_state(1)[0])
    return got, slot


def needed_bytes(mem: UnifiedMemory, seq_len: int) -> int:
    """Bytes a decode rank must receive: the pages each pool's rule keeps, one slot."""
    total = 0
    n = -(-seq_len // mem.page_size)
    for pool in mem.pools.values():
        lay = pool.layout
        # a slot, or the pages of tokens [first_needed, seq_len) (every page for full history)
        count = 1 if lay.id_space is IdSpace.SLOT else n - lay.pool_id.first_needed(seq_len) // mem.page_size
        total += count * lay.data_bytes
    return total


def build_both_ways(*args) -> TransferPlan:
    """The plan from the list builder, checked equal (ops, counts, bounds) to the array
    builder's, and the destination-only plan's bytes in the same order either way."""
    plans = {}
    for small in (1 << 30, 0):
        old, plan_module.SMALL_PLAN = plan_module.SMALL_PLAN, small
        try:
            plans[small] = (build_plan(*args), build_plan(*args[:4], None, args[5]))
        finally:
            plan_module.SMALL_PLAN = old
    (a, a_dst), (b, b_dst) = plans.values()
    for x, y in ((a, b), (a_dst, b_dst)):
        assert [x.src.tolist(), x.dst.tolist(), x.length.tolist()] == [
            y.src.tolist(),
            y.dst.tolist(),
            y.length.tolist(),
        ]
        assert (x.pieces, x.nbytes, x.bounds) == (y.pieces, y.nbytes, y.bounds)
    assert a_dst.nbytes == a.nbytes and a_dst.num_ops <= a.num_ops
    return a


def check_layouts(
    name: str | ModelSpec,
    pp: int,
    tp_p: int,
    tp_d: int,
    page_size: int,
    seq_len: int,
    pp_d: int = 1,
    pp_rank_d: int = 0,
) -> None:
    n = -(-seq_len // page_size)
    pre = {}
    for p in range(pp):
        for t in range(tp_p):
            mem = meta_memory(name, pp, tp_p, p, t, page_size)
            pre[p, t] = (mem, *request(mem, n, skip=p + 2 * t + 1, shuffle=0))
    for d in range(tp_d):
        dec = meta_memory(name, pp_d, tp_d, pp_rank_d, d, page_size)
        dec_pages, dec_slot = request(dec, n, skip=d + 3, shuffle=d + 1)
        dec_bufs = buffer_set_from_memory(dec, DEC_BASE)
        dst_cells = memory_cells(dec, dec_pages, dec_slot)
        ranges = []
        for k, ((p, t), (mem, pages, slot)) in enumerate(sorted(pre.items())):
            base = PRE_BASE + k * RANK_STRIDE
            bufs = buffer_set_from_memory(mem, base)
            pairs = pair_entries(bufs, dec_bufs)  # only the layers both stages hold
            plan = build_both_ways(bufs, dec_bufs, pairs, seq_len, memory_cells(mem, pages, slot), dst_cells)
            want = merge_runs(*expected_atoms(mem, base, pages, slot, dec, DEC_BASE, dec_pages, dec_slot, seq_len))
            got = list(zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True))
            assert got == want, f"prefill pp{p} tp{t} -> decode tp{d}"
            assert plan.num_ops == len(want)  # one op per contiguous run
            assert plan.nbytes == int(plan.length.sum())
            b = plan.bounds  # from the cell ids alone, yet they hold every op
            if plan.num_ops:
                assert b.src_lo <= plan.src.min() and (plan.src + plan.length).max() <= b.src_hi
                assert b.dst_lo <= plan.dst.min() and (plan.dst + plan.length).max() <= b.dst_hi
                assert 0 < b.min_len <= plan.length.min()
            ranges += list(zip(plan.dst.tolist(), plan.length.tolist(), strict=True))
        ranges.sort()
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(ranges))
        assert sum(n for _, n in ranges) == needed_bytes(dec, seq_len), f"decode tp{d}"


TINY = ["tiny-gdn", "tiny-swa2-state", "tiny-kda-mla", "tiny-dense", "tiny-mamba-mlp"]
TP_PAIRS = [(1, 1), (1, 4), (2, 1), (2, 4), (4, 2), (4, 4)]


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize(("tp_p", "tp_d"), TP_PAIRS)
def test_tiny_presets_match_the_independent_expectation(name, pp, tp_p, tp_d):
    check_layouts(name, pp, tp_p, tp_d, page_size=4, seq_len=27)


@pytest.mark.parametrize(
    ("name", "pp", "tp_p", "tp_d"),
    [
        ("Qwen3-Next-80B-A3B-Instruct", 4, 1, 2),
        ("Qwen3-Next-80B-A3B-Instruct", 2, 4, 1),
        ("DeepSeek-V3", 4, 2, 1),
        ("gpt-oss-20b", 2, 1, 4),
        ("gpt-oss-20b", 1, 4, 2),
        ("Kimi-Linear-48B-A3B-Instruct", 2, 2, 4),
    ],
)
def test_real_presets_match_the_independent_expectation(name, pp, tp_p, tp_d):
    check_layouts(name, pp, tp_p, tp_d, page_size=16, seq_len=150)


@pytest.mark.parametrize("name", ["tiny-swa2-state", "tiny-kda-mla"])
@pytest.mark.parametrize(("pp", "pp_rank_d"), [(4, 0), (4, 1), (1, 1), (2, 1)])
def test_decode_pp_stages_take_only_their_layers(name, pp, pp_rank_d):
    check_layouts(name, pp, 2, 1, page_size=4, seq_len=27, pp_d=2, pp_rank_d=pp_rank_d)


def state_split_on(dims: tuple[int | None, ...]) -> ModelSpec:
    """Recurrent layers whose state tensors TP splits along ``dims`` (None: replicated)."""
    states = tuple(StateTensor(f"s{i}_{dim}", (4, 8, 12), torch.float32, dim) for i, dim in enumerate(dims))
    kinds = [Linear("custom", states), FullAttention(2, 8, 8), Linear("custom", states)]
    return ModelSpec.from_kinds("tiny-state-split", kinds, kv_dtype=torch.float32, max_context=64)


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_each_state_tensor_moves_along_its_own_tp_dim(tp_p, tp_d):
    """The plan slices every tensor along its own ``tp_dim`` (the expectation reads it too,
    so a state split on dim 1 or 2, or replicated, is checked, not assumed to be dim 0)."""
    check_layouts(state_split_on((0, 1, 2, None)), 1, tp_p, tp_d, page_size=4, seq_len=27)


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2), (4, 2)])
def test_the_byte_pattern_follows_each_tensors_tp_dim(tp_p, tp_d):
    """Prefill ranks fill their slices of the global pattern; copying every plan's bytes
    gives each decode rank exactly ``expected_arena`` (a pattern that assumed dim 0 would
    put a dim-1/2 slice's bytes, or a replicated tensor's, in the wrong place)."""
    spec, seq_len, ps = state_split_on((0, 1, 2, None)), 27, 4

    def cpu(tp: int, rank: int) -> UnifiedMemory:
        return UnifiedMemory.create(
            ShardSpec(spec, Parallel(tp, 1), 0, rank), "2MiB", page_size=ps, max_context=64, chunk_tokens=16
        )

    n = -(-seq_len // ps)
    pre = []
    for t in range(tp_p):
        mem = cpu(tp_p, t)
        pages, slot = request(mem, n, skip=t + 1, shuffle=0)
        fill(mem, pages, slot, seq_len, seed=5)
        pre.append((mem, pages, slot, buffer_set_from_memory(mem)))
    for d in range(tp_d):
        dec = cpu(tp_d, d)
        dec.arena.buffer.zero_()
        dec_pages, dec_slot = request(dec, n, skip=d + 2, shuffle=d + 1)
        dec_bufs, dst = buffer_set_from_memory(dec), memory_cells(dec, dec_pages, dec_slot)
        out, dec_base = dec.arena.buffer.numpy(), dec.arena.buffer.data_ptr()
        for mem, pages, slot, bufs in pre:
            plan = build_plan(
                bufs, dec_bufs, pair_entries(bufs, dec_bufs), seq_len, memory_cells(mem, pages, slot), dst
            )
            src, base = mem.arena.buffer.numpy(), mem.arena.buffer.data_ptr()
            for s, t, length in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True):
                out[t - dec_base : t - dec_base + length] = src[s - base : s - base + length]
        assert mismatch(dec, expected_arena(dec, [(dec_pages, dec_slot, seq_len, 5)])) == "", f"decode tp{d}"


# --- prepared plans: the destination ahead, the source later -----------------------------

PROPERTY_LAYOUTS = [("tiny-swa2-state", 1, 1), ("tiny-dense", 1, 2), ("tiny-gdn", 2, 1), ("tiny-kda-mla", 2, 4)]


def plan_or_error(fn, *args) -> tuple:
    """What ``fn(*args)`` gives: its ops, counts and bounds, or the ``PlanError`` it raised."""
    try:
        p = fn(*args)
    except PlanError as exc:
        return ("error", str(exc))
    return (p.src.tolist(), p.dst.tolist(), p.length.tolist(), p.pieces, p.nbytes, p.bounds, p.num_ops)


def scrambled(mem: UnifiedMemory, pages: np.ndarray, slot: int | None, data, lists: bool, spoiled: list) -> dict:
    """A request's cells, each pool's in a drawn order, some drawn into ones no cell may be
    (0, -1, beyond the pool, another position's), as lists or arrays."""
    out = {}
    for name, cells in memory_cells(mem, pages, slot).items():
        cells = cells.tolist()
        cells = data.draw(st.permutations(cells), label=f"{name} order")
        if cells and data.draw(st.integers(0, 3), label=f"{name} spoil?") == 0:
            i = data.draw(st.integers(0, len(cells) - 1), label=f"{name} position")
            cells[i] = data.draw(st.sampled_from([0, -1, 10**6, cells[-1], cells[-1]]), label=f"{name} bad cell")
            spoiled.append(name)
        out[name] = cells if lists else np.array(cells, dtype=np.int64)
    return out


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_prepared_plans_give_the_ops_and_errors_of_both_builders(data):
    """``Route.complete(Route.prepare(...))`` equals the list builder's ``plan`` and the array
    builder's (ops, counts, bounds, or the same ``PlanError``), full and destination-only,
    for drawn orders, lengths and bad cells on either side; a ``Destination`` completes any
    number of plans to the same ops."""
    name, tp_p, tp_d = data.draw(st.sampled_from(PROPERTY_LAYOUTS), label="layout")
    seq_len = data.draw(st.integers(1, 40), label="seq_len")
    n = -(-seq_len // 4)
    mem = meta_memory(name, 1, tp_p, 0, data.draw(st.integers(0, tp_p - 1), label="prefill rank"), 4)
    dec = meta_memory(name, 1, tp_d, 0, data.draw(st.integers(0, tp_d - 1), label="decode rank"), 4)
    pages, slot = request(mem, n, skip=data.draw(st.integers(0, 3)), shuffle=0)
    dpages, dslot = request(dec, n, skip=data.draw(st.integers(0, 3)), shuffle=0)
    bufs, dbufs = buffer_set_from_memory(mem, PRE_BASE), buffer_set_from_memory(dec, DEC_BASE)
    route = plan_module.Route(bufs, dbufs, pair_entries(bufs, dbufs))
    spoiled: list[str] = []
    src = scrambled(mem, pages, slot, data, False, spoiled)
    dst = scrambled(dec, dpages, dslot, data, data.draw(st.booleans(), label="dst as lists"), spoiled)
    for full in (True, False):
        s = src if full else None
        results = []
        for small in (1 << 30, 0):
            old, plan_module.SMALL_PLAN = plan_module.SMALL_PLAN, small
            try:
                results.append(plan_or_error(route.plan, seq_len, s, dst))
                try:
                    dest = route.prepare(seq_len, dst, full)
                except PlanError as exc:
                    results.append(("error", str(exc)))
                else:
                    results.append(plan_or_error(route.complete, dest, s))
                    results.append(plan_or_error(route.complete, dest, s))  # again: the same
            finally:
                plan_module.SMALL_PLAN = old
        if all(r[0] != "error" for r in results):
            assert all(r == results[0] for r in results)
        else:  # every builder refuses; one fault on one side gives one message
            assert all(r[0] == "error" for r in results), results
            if len(spoiled) == 1:
                assert len({r[1] for r in results}) == 1, results


def test_a_destination_completes_only_its_kind_of_plan():
    mem, dec = meta_memory("tiny-dense", 1, 1, 0, 0, 4), meta_memory("tiny-dense", 1, 1, 0, 0, 4)
    pages, _ = request(mem, 3, skip=1, shuffle=0)
    dpages, _ = request(dec, 3, skip=2, shuffle=1)
    bufs, dbufs = buffer_set_from_memory(mem, PRE_BASE), buffer_set_from_memory(dec, DEC_BASE)
    route = plan_module.Route(bufs, dbufs, pair_entries(bufs, dbufs))
    src, dst = memory_cells(mem, pages, None), memory_cells(dec, dpages, None)
    with pytest.raises(ValueError, match="destination-only"):
        route.complete(route.prepare(12, dst, full=False), src)
    with pytest.raises(ValueError, match="full"):
        route.complete(route.prepare(12, dst), None)
    with pytest.raises(PlanError, match="pool"):
        route.complete(route.prepare(12, dst), dict(src, nope=[1]))
