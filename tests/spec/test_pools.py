"""Pool ids and the kind registry: typed ids, one history rule per pool, kinds that agree
with the layouts memory builds from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from hybridkv.memory import UnifiedMemory, build_layouts
from hybridkv.spec import (
    FULL_POOL,
    MLA_POOL,
    RECURRENT_POOL,
    IdSpace,
    Parallel,
    PoolId,
    PoolIdError,
    ShardSpec,
    WindowPool,
    get_preset,
    preset_names,
)


def test_history_rules_match_their_definitions():
    for seq_len in range(0, 50):
        assert FULL_POOL.span(seq_len) == MLA_POOL.span(seq_len) == (0, seq_len)
        assert WindowPool(8).span(seq_len) == (max(0, seq_len - 8), seq_len)
        assert RECURRENT_POOL.span(seq_len) == (seq_len, seq_len)  # no tokens ...
    assert RECURRENT_POOL.needs_state and not WindowPool(8).needs_state  # ... but a state at L
    lens = np.arange(50, dtype=np.int64)
    for pool in (FULL_POOL, MLA_POOL, WindowPool(8), RECURRENT_POOL):
        assert np.array_equal(pool.first_needed(lens), [pool.first_needed(int(n)) for n in lens]), pool
        assert pool.max_span is None or (lens - pool.first_needed(lens) <= pool.max_span).all()
        pool.check_rule(200)  # the invariants, each pool id's own (a token pool's token at L - 1 reads itself)
    assert WindowPool(8).page_span(21, 4) == (3, 6) and FULL_POOL.page_span(21, 4) == (0, 6)
    assert WindowPool(8).page_span(7, 4) == (0, 2) and WindowPool(4).page_span(24, 4) == (5, 6)
    assert [p.keeps_history for p in (FULL_POOL, MLA_POOL, WindowPool(8), RECURRENT_POOL)] == [1, 1, 0, 0]
    assert [p.releases_history for p in (FULL_POOL, MLA_POOL, WindowPool(8), RECURRENT_POOL)] == [0, 0, 1, 0]


def test_pool_ids_are_typed_values_with_a_display_form():
    ids = [FULL_POOL, MLA_POOL, WindowPool(1024), RECURRENT_POOL]
    assert [str(p) for p in ids] == ["full", "mla", "swa:1024", "state"]
    assert [PoolId.parse(str(p)) for p in ids] == ids
    assert all(p != str(p) for p in ids) and "full" not in {FULL_POOL: 1}  # display never looks up
    assert FULL_POOL.id_space is IdSpace.PAGE and RECURRENT_POOL.id_space is IdSpace.SLOT
    assert sorted([RECURRENT_POOL, WindowPool(24), WindowPool(8), MLA_POOL, FULL_POOL], key=PoolId.sort_key) == [
        FULL_POOL,
        MLA_POOL,
        WindowPool(8),
        WindowPool(24),
        RECURRENT_POOL,
    ]
    with pytest.raises(PoolIdError, match="unknown pool family 'sw'"):
        PoolId.parse("sw:8")
    with pytest.raises(PoolIdError, match="needs its window"):
        PoolId.parse("swa")
    with pytest.raises(PoolIdError, match="takes no parameter"):
        PoolId.parse("full:3")
    with pytest.raises(PoolIdError, match="is not an integer"):
        PoolId.parse("swa:x")


def test_a_family_name_belongs_to_one_class():
    with pytest.raises(PoolIdError, match="family 'swa' is taken by WindowPool"):

        @dataclass(frozen=True)
        class OtherWindow(PoolId):
            family: ClassVar[str] = "swa"

    # a class of the same name in another module (a test's copy of a product kind) is refused too
    same_name = {"family": "swa", "__module__": "tests.elsewhere", "__qualname__": "WindowPool"}
    with pytest.raises(PoolIdError, match=r"'swa' is taken by WindowPool \(hybridkv.spec.pools\); WindowPool \(tests"):
        type("WindowPool", (PoolId,), same_name)
    assert PoolId.parse("swa:8") == WindowPool(8)


def test_memory_lookups_refuse_display_strings_and_say_what_to_pass():
    mem = UnifiedMemory.create(ShardSpec.whole(get_preset("tiny-swa")), 200_000, page_size=4, max_context=32)
    with pytest.raises(TypeError, match=r"PoolId.parse\('swa:8'\)"):
        mem.resident(mem.alloc_pages(1), "swa:8")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", preset_names())
def test_layouts_agree_with_what_each_kind_says(name):
    model = get_preset(name)
    tp = 2 if name.startswith("tiny") else 8
    for tp_rank in (0, tp - 1):
        try:
            shard = ShardSpec(model, Parallel(tp_size=tp), 0, tp_rank)
        except ValueError:  # a model whose heads TP 8 cannot split: the spec tests cover the error
            continue
        layouts = {lay.pool_id: lay for lay in build_layouts(shard, 16)}
        kinds = {lid: shard.local_kind(lid) for lid in (layer.layer_id for layer in shard.layers)}
        assert set(layouts) == {k.pool_id for k in kinds.values() if k.pool_id is not None}
        for pool, lay in layouts.items():
            mine = [k for k in kinds.values() if k.pool_id == pool]
            if pool.id_space is IdSpace.PAGE:
                assert lay.data_bytes == 16 * sum(k.bytes_per_token(model.kv_dtype) for k in mine)
            else:
                assert lay.data_bytes == sum(k.bytes_per_request(model.kv_dtype) for k in mine)
            for lid, kind in kinds.items():
                for t in kind.cell_tensors(lay.page_size, model.kv_dtype) if kind.pool_id == pool else ():
                    seg = lay.segment(lid, t.name)
                    assert (seg.shape, seg.dtype, seg.tp_dim) == (t.shape, t.dtype, t.tp_dim)


def test_recompute_cost_follows_each_pools_history_rule():
    qwen = get_preset("Qwen3-Next-80B-A3B-Instruct")  # 12 full-attention layers, 36 GatedDeltaNet
    full = [qwen.recompute_flops_per_token(FULL_POOL, p) for p in (0, 99, 999)]
    assert full == [12 * 2 * 2 * (256 + 256) * (p + 1) for p in (0, 99, 999)]  # grows with the history
    state = {qwen.recompute_flops_per_token(RECURRENT_POOL, p) for p in (0, 99, 999)}
    assert state == {36 * 2 * (8192 * 3 + 32 * 128 * 128)}  # one update of the state, any position
    gemma = get_preset("Gemma-3-27B-IT")
    window = [gemma.recompute_flops_per_token(WindowPool(1024), p) for p in (10, 1023, 5000)]
    assert window[0] < window[1] == window[2]  # capped at the window
