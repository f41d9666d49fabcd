"""BufferSet construction and pairing: ids aligned 1:1, pairing by id, every mismatch named."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import KindTag, ModelSpec, Parallel, ShardSpec, WindowPool, get_preset
from hybridkv.testing.harness import variant
from hybridkv.transfer import (
    BadLayout,
    BufferSet,
    LayoutMismatch,
    PlanError,
    ProtocolError,
    buffer_set_from_memory,
    build_plan,
    expand_layer_ids,
    memory_cells,
    pair_entries,
)
from hybridkv.transfer import plan as plan_module
from hybridkv.transfer.auth import MAC_BYTES, ClusterKey, Gate, Seal
from hybridkv.transfer.messages import Hello, Rank
from tests.devices import device, no_host_sync

BASE = 1 << 40


def memory(
    model: ModelSpec | str,
    pp: int = 1,
    tp: int = 1,
    pp_rank: int = 0,
    tp_rank: int = 0,
    page_size: int = 4,
    device: str = "meta",
) -> UnifiedMemory:
    spec = get_preset(model) if isinstance(model, str) else model
    return UnifiedMemory.create(
        ShardSpec(spec, Parallel(tp, pp), pp_rank, tp_rank),
        "2MiB",
        device=device,
        page_size=page_size,
        max_context=64,
        chunk_tokens=16,
    )


def bufs(*args, base: int = BASE, **kw) -> BufferSet:
    return buffer_set_from_memory(memory(*args, **kw), base)


# --- BufferSet -----------------------------------------------------------------------


def test_layer_ids_expand_once_per_buffer_group():
    assert expand_layer_ids([3, 7], 4, "x") == (3, 7, 3, 7)
    assert expand_layer_ids([3, 7, 3, 7], 4, "x") == (3, 7, 3, 7)
    with pytest.raises(BadLayout, match="multiple of the id count"):
        expand_layer_ids([3, 7, 9], 4, "pool 'full'")


def test_mha_publishes_k_then_v_with_ids_twice_and_hybrid_pools_only_their_layers():
    b = bufs("tiny-swa2-state")
    by_pool: dict[str, list[tuple[int, str]]] = {}
    for entry, lid in zip(b.entries, b.layer_ids, strict=True):
        by_pool.setdefault(entry.pool, []).append((lid, entry.tensor))
    assert by_pool["full"] == [(3, "k"), (7, "k"), (3, "v"), (7, "v")]
    assert by_pool["swa:8"] == [(0, "k"), (4, "k"), (0, "v"), (4, "v")]
    assert by_pool["swa:24"] == [(2, "k"), (6, "k"), (2, "v"), (6, "v")]
    names = ("conv_q", "conv_k", "conv_v", "recurrent_state")
    assert by_pool["state"] == [(layer, name) for name in names for layer in (1, 5)]
    mla = bufs("tiny-kda-mla")
    assert [lid for e, lid in zip(mla.entries, mla.layer_ids, strict=True) if e.pool == "mla"] == [3, 7]


def test_real_hybrid_preset_publishes_full_attention_and_state_by_their_own_ids():
    model = get_preset("Qwen3-Next-80B-A3B-Instruct")
    mem = UnifiedMemory.create(
        ShardSpec(model, Parallel(2, 4), 1, 0), "4GiB", device="meta", page_size=16, max_context=256, chunk_tokens=64
    )
    b = buffer_set_from_memory(mem, BASE)
    start, end = b.layer_range
    full = sorted({lid for e, lid in zip(b.entries, b.layer_ids, strict=True) if e.pool == "full"})
    state = sorted({lid for e, lid in zip(b.entries, b.layer_ids, strict=True) if e.pool == "state"})
    assert full == [i for i in model.layer_ids(KindTag.FULL) if start <= i < end]
    assert state == [i for i in range(start, end) if i not in full]
    assert all(e.stride == mem.pools[e.pool_id].cell_bytes for e in b.entries)


def test_bufferset_rejects_misaligned_ids_foreign_layers_and_unregistered_entries():
    b = bufs("tiny-dense")
    with pytest.raises(BadLayout, match="aligned 1:1"):
        msgspec.structs.replace(b, layer_ids=b.layer_ids[:-1])
    with pytest.raises(BadLayout, match="outside the stage"):
        msgspec.structs.replace(b, layer_ids=(9,) * len(b.entries))
    with pytest.raises(BadLayout, match="outside every registered region"):
        msgspec.structs.replace(b, regions=((BASE, 1024),))
    with pytest.raises(BadLayout, match="item_len"):
        msgspec.structs.replace(b.entries[0], item_len=b.entries[0].item_len + 4)


def test_a_malformed_layout_on_the_wire_is_a_protocol_error():
    """Even a frame with a valid MAC (a key holder's) is decoded and checked before use."""
    b = bufs("tiny-dense")
    key = ClusterKey.generate()
    hello = Hello(Rank("d", 0, 0), "tcp://x:1", "shm", "s", b)
    frame = Seal(key, hello.rank).seal("me", hello)
    assert Gate(key).open(frame, "me").body == hello
    raw = msgspec.msgpack.decode(frame[MAC_BYTES:])  # [sender, epoch, seq, to, body]
    raw[4]["buffers"]["layer_ids"] = raw[4]["buffers"]["layer_ids"][:-1]
    body = msgspec.msgpack.encode(raw)
    with pytest.raises(ProtocolError, match="aligned 1:1"):
        Gate(key).open(key.mac(body) + body, "me")
    with pytest.raises(ProtocolError, match="malformed"):
        Gate(key).open(key.mac(b"\x00garbage") + b"\x00garbage", "me")


# --- pairing --------------------------------------------------------------------------


def test_pairing_by_id_follows_pp_stages_and_positional_pairing_is_refused_for_pp():
    dec = bufs("tiny-swa2-state")
    stage1 = bufs("tiny-swa2-state", pp=2, pp_rank=1)
    pairs = pair_entries(stage1, dec)
    assert sorted({p.layer_id for p in pairs}) == [4, 5, 6, 7]
    for p in pairs:
        assert stage1.layer_ids[p.src] == dec.layer_ids[p.dst] == p.layer_id
        assert stage1.entries[p.src].tensor == dec.entries[p.dst].tensor
    # positionally, stage 1's first entry would have fed decode's layer 3: refused
    with pytest.raises(LayoutMismatch, match="one PP stage"):
        pair_entries(stage1, dec, positional=True)
    whole = bufs("tiny-swa2-state")
    assert set(pair_entries(whole, dec, positional=True)) == set(pair_entries(whole, dec))


def test_positional_pairing_refuses_disagreeing_ids():
    dec = bufs("tiny-dense")
    pre = bufs("tiny-dense")
    order = [1, 0, *range(2, len(pre.entries))]
    swapped = msgspec.structs.replace(
        pre, entries=tuple(pre.entries[i] for i in order), layer_ids=tuple(pre.layer_ids[i] for i in order)
    )
    with pytest.raises(LayoutMismatch, match="wrong layer"):
        pair_entries(swapped, dec, positional=True)
    assert {(p.layer_id, swapped.entries[p.src].tensor) for p in pair_entries(swapped, dec)} == {
        (dec.layer_ids[i], e.tensor) for i, e in enumerate(dec.entries)
    }


def drop_layer(b: BufferSet, lid: int) -> BufferSet:
    keep = [i for i, x in enumerate(b.layer_ids) if x != lid]
    return msgspec.structs.replace(
        b, entries=tuple(b.entries[i] for i in keep), layer_ids=tuple(b.layer_ids[i] for i in keep)
    )


def test_missing_layer_and_entry_count_mismatch_name_both_sides():
    pre, dec = bufs("tiny-gdn"), bufs("tiny-gdn")
    with pytest.raises(LayoutMismatch, match=r"prefill tiny-gdn pp 0/1.*decode tiny-gdn.*layer 3.*missing on decode"):
        pair_entries(pre, drop_layer(dec, 3))
    with pytest.raises(LayoutMismatch, match="decode expects layer 3"):
        pair_entries(drop_layer(pre, 3), dec)
    half = [i for i, x in enumerate(dec.layer_ids) if not (x == 3 and dec.entries[i].tensor == "v")]
    dec_k_only = msgspec.structs.replace(
        dec, entries=tuple(dec.entries[i] for i in half), layer_ids=tuple(dec.layer_ids[i] for i in half)
    )
    with pytest.raises(LayoutMismatch, match=r"layer 3 has 2 entries on prefill \['k', 'v'\] but 1"):
        pair_entries(pre, dec_k_only)


@pytest.mark.parametrize(
    ("decode_kw", "message"),
    [
        ({"model": variant("tiny-gdn", head_dim=16)}, r"item length mismatch.*layer 3 'k'.*\(4, 4, 8\).*\(4, 4, 16\)"),
        (
            {"model": variant("tiny-gdn", state_dim=4)},
            r"state slot size mismatch.*layer 0 'conv_q'.*\(32, 3\), 384 B per slot.*\(32, 4\)",
        ),
        ({"model": variant("tiny-gdn", kv_dtype=torch.bfloat16)}, r"dtype mismatch.*float32.*bfloat16"),
        ({"model": "tiny-gdn", "page_size": 8}, r"page size mismatch.*same page_size"),
        ({"model": "tiny-swa"}, r"prefill serves model 'tiny-gdn', decode 'tiny-swa'"),
    ],
)
def test_geometry_mismatches_are_errors_naming_both_sides(decode_kw, message):
    pre = bufs("tiny-gdn")
    kw = dict(decode_kw)
    dec = bufs(kw.pop("model"), **kw)
    with pytest.raises(LayoutMismatch, match=message) as info:
        pair_entries(pre, dec)
    assert "prefill" in str(info.value) and "decode" in str(info.value)


# --- plans: errors and no host sync ---------------------------------------------------


@pytest.fixture(params=["lists", "arrays"])
def builder(request, monkeypatch):
    """Both plan builders: Python lists (small plans) and numpy arrays (large ones)."""
    monkeypatch.setattr(plan_module, "SMALL_PLAN", 1 << 30 if request.param == "lists" else 0)
    return request.param


def test_plan_refuses_bad_cells_before_any_byte_moves(builder):
    pre_mem, dec_mem = memory("tiny-swa"), memory("tiny-swa")
    pre, dec = buffer_set_from_memory(pre_mem, BASE), buffer_set_from_memory(dec_mem, 2 * BASE)
    pairs = pair_entries(pre, dec)
    pages, dpages = pre_mem.alloc_pages(6), dec_mem.alloc_pages(6)
    src, dst = memory_cells(pre_mem, pages, None), memory_cells(dec_mem, dpages, None)
    assert build_plan(pre, dec, pairs, 23, src, dst).nbytes > 0
    bad = dict(dst, full=np.array([*dst["full"][:5], 10**9]))
    with pytest.raises(PlanError, match=r"decode cell 1000000000 .* pool 'full' .* outside \[1, "):
        build_plan(pre, dec, pairs, 23, src, bad)
    with pytest.raises(PlanError, match="is outside"):
        build_plan(pre, dec, pairs, 23, src, dict(dst, full=np.array([0, *dst["full"][1:]])))
    with pytest.raises(PlanError, match=r"decode gave 3 pages for pool 'full'.*needs 6"):
        build_plan(pre, dec, pairs, 23, src, dict(dst, full=dst["full"][:3]))
    dup = dict(dst, full=np.array([*dst["full"][:5], dst["full"][0]]))
    with pytest.raises(PlanError, match="same decode bytes"):
        build_plan(pre, dec, pairs, 23, src, dup)
    # window pages are those of tokens [15, 23): pages that left the window do not matter
    pre_mem.windows.free(pages[:3], WindowPool(8))
    dec_mem.windows.free(dpages[:3], WindowPool(8))
    dst = memory_cells(dec_mem, dpages, None)
    assert build_plan(pre, dec, pairs, 23, memory_cells(pre_mem, pages, None), dst).nbytes > 0
    pre_mem.windows.free(pages[4:5], WindowPool(8))  # a window page the prefill lost
    with pytest.raises(PlanError, match=r"prefill cell -1 for position 4 of pool 'swa:8'.*tombstone"):
        build_plan(pre, dec, pairs, 23, memory_cells(pre_mem, pages, None), dst)


def test_window_pages_and_one_state_slot_only():
    pre_mem, dec_mem = memory("tiny-swa2-state"), memory("tiny-swa2-state")
    pre, dec = buffer_set_from_memory(pre_mem, BASE), buffer_set_from_memory(dec_mem, 2 * BASE)
    pages, dpages = pre_mem.alloc_pages(10), dec_mem.alloc_pages(10)
    slot, dslot = int(pre_mem.alloc_state(1)[0]), int(dec_mem.alloc_state(1)[0])
    pre_mem.windows.free(pages[:5], WindowPool(8))  # out of the 8-token window at 38 tokens
    dst = memory_cells(dec_mem, dpages, dslot)
    plan = build_plan(pre, dec, pair_entries(pre, dec), 38, memory_cells(pre_mem, pages, slot), dst)
    written = np.zeros(dec_mem.arena.nbytes, dtype=bool)
    for a, n in zip(plan.dst - 2 * BASE, plan.length, strict=True):
        written[a : a + n] = True
    touched = {}
    for pool_id, pool in dec_mem.pools.items():
        name = str(pool_id)  # plan cells are keyed like the entries' pool
        spans = [(c * pool.cell_bytes, c * pool.cell_bytes + pool.layout.data_bytes) for c in dst[name]]
        assert all(written[a:b].all() or not written[a:b].any() for a, b in spans)  # whole cells
        touched[name] = {int(c) for c, (a, b) in zip(dst[name], spans, strict=True) if written[a:b].any()}
    assert touched["swa:8"] == set(dst["swa:8"][7:].tolist())  # tokens [30, 38): pages 7..9
    assert touched["swa:24"] == set(dst["swa:24"][3:].tolist())  # tokens [14, 38): pages 3..9
    assert touched["state"] == {int(dst["state"][0])}


@pytest.mark.host_sync
def test_planning_never_reads_device_memory():
    pre_mem, dec_mem = memory("tiny-swa2-state", device=device()), memory("tiny-swa2-state", device=device())
    pages, dpages = pre_mem.alloc_pages(5), dec_mem.alloc_pages(5)
    slot, dslot = int(pre_mem.alloc_state(1)[0]), int(dec_mem.alloc_state(1)[0])
    with no_host_sync() as counter:
        pre, dec = buffer_set_from_memory(pre_mem), buffer_set_from_memory(dec_mem)
        plan = build_plan(
            pre,
            dec,
            pair_entries(pre, dec),
            20,
            memory_cells(pre_mem, pages, slot),
            memory_cells(dec_mem, dpages, dslot),
        )
    assert plan.num_ops > 0
    assert counter.total == 0, dict(counter.counts)
