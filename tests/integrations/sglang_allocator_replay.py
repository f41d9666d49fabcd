"""The token-to-KV allocator replay, run by ``sglang_parity_driver.py`` under SGLang's python.

Seeded scheduler-shaped call sequences (prefill extends that continue a request's partial page,
decodes, raw page-aligned ``alloc``, finishes by ``free`` / ``free_segment`` / ``free_page_ids``, some
inside free groups, running requests retracted) against SGLang's own ``TokenToKVPoolAllocator`` (page
size 1) or ``PagedTokenToKVPoolAllocator`` and ``HybridKVTokenToKVPoolAllocator`` of the same size, on
CPU over a real ``MHATokenToKVPool``. Each step records both sides' success and ``available_size``;
``problems`` lists every broken location invariant on either side and every ``mem.verify()`` failure.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import torch


def _pools(size: int, ps: int) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from hybridkv.integrations.sglang.allocator import HybridKVTokenToKVPoolAllocator

    kv = MHATokenToKVPool(size, ps, torch.float16, 1, 8, 1, "cpu", False)
    if ps == 1:
        sg: Any = TokenToKVPoolAllocator(size, torch.float16, "cpu", kv, False)
    else:
        sg = PagedTokenToKVPoolAllocator(size, ps, torch.float16, "cpu", kv, False)
    return sg, HybridKVTokenToKVPoolAllocator(size, ps, torch.float16, "cpu", kv, False)


def _check_rows(name: str, rows: dict[int, list[int]], ps: int, num_pages: int) -> list[str]:
    """Each row page-aligned (position ``p`` at offset ``p % ps`` of one page per ``ps`` positions),
    inside SGLang's KV buffers, no location (or page) in two rows."""
    problems = []
    owner: dict[int, int] = {}
    for rid, row in rows.items():
        for pos, loc in enumerate(row):
            if not ps <= loc < (num_pages + 1) * ps:
                problems.append(f"{name}: row {rid} position {pos} location {loc} outside the pool")
            if loc % ps != pos % ps:
                problems.append(f"{name}: row {rid} position {pos} location {loc} at the wrong page offset")
            if pos % ps and loc // ps != row[pos - 1] // ps:
                problems.append(f"{name}: row {rid} position {pos} leaves the page of position {pos - 1}")
        for page in {loc // ps for loc in row}:
            if owner.setdefault(page, rid) != rid:
                problems.append(f"{name}: page {page} in rows {owner[page]} and {rid}")
    return problems


def allocator_replay(ps: int, seed: int, steps: int, size: int) -> dict[str, Any]:
    sg, hk = _pools(size, ps)
    sides = (sg, hk)
    rng = random.Random(seed)
    rows: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})  # per side: request -> its locations
    out_rows: list[dict[str, Any]] = []
    problems: list[str] = []
    next_id = 0
    counts: dict[str, int] = {}

    def finish(rid: int, how: str) -> None:
        for alloc, held in zip(sides, rows, strict=True):
            row = torch.tensor(held.pop(rid), dtype=torch.int64)
            if how == "free":
                alloc.free(row)
            elif how == "segments":  # a cached head and an uncached tail, split on a page boundary
                cut = rng_cut[0]
                alloc.free_segments([(row[:cut], 0), (row[cut:], cut)])
            else:  # the pages, one representative each
                alloc.free_page_ids(row[::ps] // ps)

    for step in range(steps):
        op = rng.choices(["extend", "decode", "alloc", "finish", "group"], [4, 3, 1, 2, 1])[0]
        running = sorted(rows[0])
        row: dict[str, Any] = {"step": step, "op": op}
        results: list[Any] = []
        if op == "extend":
            batch = []
            for _ in range(rng.randint(1, 3)):
                if running and rng.random() < 0.4:
                    rid = running.pop(rng.randrange(len(running)))
                else:
                    rid, next_id = next_id, next_id + 1
                batch.append((rid, rng.randint(1, 3 * ps + 5)))
            for alloc, held in zip(sides, rows, strict=True):
                pre = [len(held.get(rid, [])) for rid, _ in batch]
                seq = [p + n for p, (_, n) in zip(pre, batch, strict=True)]
                if ps == 1:
                    got = alloc.alloc(sum(n for _, n in batch))
                else:
                    last = [held[rid][-1] if held.get(rid) else -1 for rid, _ in batch]
                    p_t, s_t = torch.tensor(pre), torch.tensor(seq)
                    got = alloc.alloc_extend(p_t, p_t, s_t, s_t, torch.tensor(last), sum(seq) - sum(pre))
                results.append(got)
                if got is not None:
                    flat = got.tolist()
                    for rid, n in batch:
                        held.setdefault(rid, []).extend(flat[:n])
                        flat = flat[n:]
        elif op == "decode" and running:
            batch_ids = rng.sample(running, min(len(running), rng.randint(1, 4)))
            for alloc, held in zip(sides, rows, strict=True):
                if ps == 1:
                    got = alloc.alloc(len(batch_ids))
                else:
                    seq = torch.tensor([len(held[rid]) + 1 for rid in batch_ids])
                    last = torch.tensor([held[rid][-1] for rid in batch_ids])
                    got = alloc.alloc_decode(seq, seq, last)
                results.append(got)
                if got is not None:
                    for rid, loc in zip(batch_ids, got.tolist(), strict=True):
                        held[rid].append(loc)
        elif op == "alloc":
            n = rng.randint(1, 4) * ps
            rid, next_id = next_id, next_id + 1
            for alloc, held in zip(sides, rows, strict=True):
                got = alloc.alloc(n)
                results.append(got)
                if got is not None:
                    held[rid] = got.tolist()
        elif op in ("finish", "group") and running:
            victims = rng.sample(running, min(len(running), 1 if op == "finish" else rng.randint(2, 4)))
            hows = [rng.choice(["free", "segments", "pages"]) for _ in victims]
            for alloc in sides:
                if op == "group":
                    alloc.free_group_begin()
            for rid, how in zip(victims, hows, strict=True):
                n = len(rows[0][rid])
                rng_cut[0] = rng.randint(0, n // ps) * ps
                finish(rid, how)
                counts[how] = counts.get(how, 0) + 1
            for alloc in sides:
                if op == "group":
                    alloc.free_group_end()
            results = [True, True]
        else:
            row["op"] = "noop"
            results = [True, True]
        row["ok"] = [r is not None for r in results]
        row["available"] = [int(a.available_size()) for a in sides]
        key = row["op"] + ("" if all(row["ok"]) else "_refused")
        counts[key] = counts.get(key, 0) + 1
        for name, held in zip(("sglang", "hybridkv"), rows, strict=True):
            problems += [f"step {step}: {p}" for p in _check_rows(name, held, ps, size // ps)]
        held_pages = {loc // ps for r in rows[1].values() for loc in r}
        live = {int(p) for p in hk.mem.pages.live.nonzero()[0] if 0 < p <= size // ps}
        if held_pages != live:
            problems.append(
                f"step {step}: hybridkv rows hold pages {sorted(held_pages ^ live)} not live or live not held"
            )
        if hk.available_size() != hk.mem.pages.free_count * ps:
            problems.append(f"step {step}: available_size {hk.available_size()} != free pages x page size")
        try:
            hk.mem.verify()
        except AssertionError as exc:
            problems.append(f"step {step}: mem.verify: {exc}")
        out_rows.append(row)
        if row["ok"][0] != row["ok"][1]:  # the two sides' requests differ from here on: stop, named
            problems.append(f"step {step}: {op} succeeded on one side only (sglang, hybridkv): {row['ok']}")
            return {"rows": out_rows, "problems": problems, "final_available": [], "reuse_all": [], "counts": counts}
    # everything back: every freed location reusable, on both sides
    for rid in sorted(rows[0]):
        finish(rid, "free")
    final = [int(a.available_size()) for a in sides]
    everything = [a.alloc(size // ps * ps) for a in sides]
    reuse = [
        sorted(t.tolist()) == list(range(ps, (size // ps + 1) * ps)) if t is not None else False for t in everything
    ]
    return {"rows": out_rows, "problems": problems, "final_available": final, "reuse_all": reuse, "counts": counts}


rng_cut = [0]  # the cut of a "segments" finish, drawn once and used on both sides


def attempt(out: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """What calling ``fn`` raised, as ``out[name]`` ("Class: message"), or "no error"."""
    try:
        fn()
        out[name] = "no error"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"


def allocator_bad_input() -> dict[str, str]:
    """Each wrong call and the error each side gives (class: message); double frees leave state unchanged."""
    from hybridkv.integrations.sglang.allocator import HybridKVTokenToKVPoolAllocator

    out: dict[str, str] = {}

    sg1, hk1 = _pools(32, 1)
    sg4, hk4 = _pools(32, 4)
    kv4 = hk4.get_kvcache()
    attempt(out, "size_below_page", lambda: HybridKVTokenToKVPoolAllocator(2, 4, torch.float16, "cpu", None))
    attempt(out, "dtype_not_dtype", lambda: HybridKVTokenToKVPoolAllocator(32, 4, "fp16", "cpu", None))  # type: ignore[arg-type]
    attempt(out, "kv_pool_page_size", lambda: HybridKVTokenToKVPoolAllocator(32, 2, torch.float16, "cpu", kv4))
    attempt(out, "kv_pool_dtype", lambda: HybridKVTokenToKVPoolAllocator(32, 4, torch.bfloat16, "cpu", kv4))
    attempt(out, "unaligned_alloc", lambda: hk4.alloc(6))
    out["sglang_unaligned_alloc_len"] = str(len(sg4.alloc(6)))
    attempt(out, "alloc_extend_page_size_1", lambda: hk1.alloc_extend(*[torch.tensor([0])] * 5, 1))
    attempt(out, "sglang_alloc_extend_page_size_1", lambda: sg1.alloc_extend(*[torch.tensor([0])] * 5, 1))
    z, s = torch.tensor([0]), torch.tensor([5])
    attempt(out, "extend_count_mismatch", lambda: hk4.alloc_extend(z, z, s, s, torch.tensor([-1]), 7))
    attempt(out, "extend_float_lens", lambda: hk4.alloc_extend(z, z, s.float(), s.float(), torch.tensor([-1]), 5))
    meta = torch.tensor([-1], device="meta")
    attempt(out, "extend_last_loc_other_device", lambda: hk4.alloc_extend(z, z, s, s, meta, 5))
    attempt(out, "free_float", lambda: hk4.free(torch.tensor([4.0])))
    attempt(out, "free_other_device", lambda: hk4.free(torch.tensor([4], device="meta")))
    attempt(out, "segment_unaligned_start", lambda: hk4.free_segment(torch.tensor([5, 6]), start_pos=1))
    for name, hk in (("ps1", hk1), ("ps4", hk4)):
        locs = hk.alloc(hk.page_size * 2)
        hk.free(locs)
        before = hk.available_size()
        attempt(out, f"double_free_{name}", lambda hk=hk, locs=locs: hk.free(locs))
        fresh = hk.alloc(hk.page_size)
        hk.free_group_begin()
        hk.free(fresh)
        hk.free_segment(fresh, start_pos=0)
        attempt(out, f"double_free_in_group_{name}", hk.free_group_end)
        hk.mem.verify()
        out[f"unchanged_{name}"] = str(hk.available_size() == before - hk.page_size and hk.free_group is None)
        hk.free(fresh)
    hk4.free_group_begin()
    attempt(out, "nested_group", hk4.free_group_begin)
    hk4.free_group_end()
    return out


def hook_section() -> dict[str, Any]:
    """The opt-in hook: off by default; ``HYBRIDKV_SGLANG_ALLOCATOR=1`` registers one AROUND hook on the
    builder, which swaps SGLang's plain allocators for hybridkv's and keeps every other one."""
    import inspect
    import pkgutil

    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.plugins.hook_registry import HookRegistry

    from hybridkv.integrations.sglang import allocator as A
    from hybridkv.integrations.sglang.plugin import register

    out: dict[str, Any] = {}
    saved = os.environ.pop(A.ENV, None)
    try:
        register()
        out["off_hooks"] = len(HookRegistry._hooks.get(A.HOOK_TARGET, []))
        os.environ[A.ENV] = "yes"
        try:
            register()
            out["bad_value"] = "no error"
        except A.HybridKVAllocatorError as exc:
            out["bad_value"] = str(exc)
        os.environ[A.ENV] = "1"
        register()
        register()
        hooks = HookRegistry._hooks.get(A.HOOK_TARGET, [])
        out["on_hooks"] = [(t.value, getattr(h, "__qualname__", "")) for t, h, _ in hooks]
        cls_path, method = A.HOOK_TARGET.rsplit(".", 1)
        params = inspect.signature(getattr(pkgutil.resolve_name(cls_path), method)).parameters
        out["builder_params"] = sorted(params)
        r2t = ReqToTokenPool(8, 128, "cpu", False)
        sg, _ = _pools(64, 4)

        def builder(built: Any) -> Any:
            return lambda *a, **kw: built

        kw = {"sizes": None, "token_to_kv_pool": sg.get_kvcache(), "is_dsv4_model": False, "req_to_token_pool": r2t}
        got = A.build_allocator_around(builder(sg), object(), token_to_kv_pool_allocator=None, **kw)
        out["plain"] = [type(got).__name__, got.size, got.page_size, str(got.dtype), got.available_size()]
        out["draft"] = type(
            A.build_allocator_around(builder(sg), object(), token_to_kv_pool_allocator=sg, **kw)
        ).__name__
        swa_kv = SWAKVPool(64, 32, 4, torch.float16, 1, 8, [1], [0], "cpu")
        swa = SWATokenToKVPoolAllocator(64, 32, 4, torch.float16, "cpu", swa_kv, False)
        out["swa"] = type(
            A.build_allocator_around(builder(swa), object(), token_to_kv_pool_allocator=None, **kw)
        ).__name__
    finally:
        HookRegistry._hooks.pop(A.HOOK_TARGET, None)
        os.environ.pop(A.ENV, None)
        if saved is not None:
            os.environ[A.ENV] = saved
    return out


def allocator_no_device_read() -> dict[str, Any]:
    """Allocation never reads device data: an allocator on the ``meta`` device (tensors without data,
    whose every host read raises) serves ``alloc`` / ``alloc_extend`` (with a partial-page continuation)
    / ``alloc_decode`` from host lengths; a free there is the one documented read, and raises."""
    from hybridkv.integrations.sglang.allocator import HybridKVTokenToKVPoolAllocator

    out: dict[str, Any] = {}
    hk = HybridKVTokenToKVPoolAllocator(64, 4, torch.float16, "meta", None)
    got = hk.alloc(8)
    out["alloc"] = [str(got.device), list(got.shape), hk.available_size()]
    pre, seq = torch.tensor([6, 0]), torch.tensor([11, 3])
    meta = {
        "prefix_lens": pre.to("meta"),
        "seq_lens": seq.to("meta"),
        "last_loc": torch.empty(2, dtype=torch.int64, device="meta"),
    }
    got = hk.alloc_extend(meta["prefix_lens"], pre, meta["seq_lens"], seq, meta["last_loc"], 8)
    out["alloc_extend"] = [str(got.device), list(got.shape), hk.available_size()]
    seq = torch.tensor([12, 5])
    got = hk.alloc_decode(seq.to("meta"), seq, meta["last_loc"])
    out["alloc_decode"] = [str(got.device), list(got.shape), hk.available_size()]
    try:
        hk.free(torch.empty(4, dtype=torch.int64, device="meta"))
        out["free"] = "no error"
    except Exception as exc:
        out["free"] = type(exc).__name__
    return out


def allocator_sizes() -> dict[str, Any]:
    """Pools whose slab rounding leaves surplus page ids (kept at construction, never handed out), and
    ``clear`` / ``resize``: the allocatable pages are exactly SGLang's ``size // page_size``, ids 1..pages."""
    from types import SimpleNamespace

    from hybridkv.integrations.sglang.allocator import HybridKVTokenToKVPoolAllocator

    out: dict[str, Any] = {}
    for size, ps in ((1000, 1), (2062, 4), (20816, 16)):
        hk = HybridKVTokenToKVPoolAllocator(size, ps, torch.float16, "cpu", None)
        pages = size // ps
        surplus = hk.mem.pages.capacity - 1 - pages
        free_ids = hk.get_all_free_pages().tolist()
        got = hk.alloc(pages * ps)
        full = got is not None and sorted(got.tolist()) == list(range(ps, (pages + 1) * ps))
        more = hk.alloc(ps)
        hk.mem.verify()
        hk.clear()
        after_clear = hk.available_size()
        hk.resize(SimpleNamespace(max_total_num_tokens=size // 2))
        hk.mem.verify()
        out[f"{size}/{ps}"] = {
            "surplus": surplus,
            "free_ids_exact": free_ids == list(range(1, pages + 1)),
            "whole_pool": full,
            "one_more": more is not None,
            "after_clear": after_clear,
            "after_resize": [hk.available_size(), hk.size, hk.num_pages],
        }
    return out
