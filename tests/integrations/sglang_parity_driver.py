"""Runs under SGLang 0.5.23's python (``.venv-sglang``) with ``src`` on ``PYTHONPATH``; writes one JSON report.

``test_sglang_parity.py`` starts it once and asserts on the report. Every section builds real SGLang
pools on the CPU (``ReqToTokenPool`` / ``HybridReqToTokenPool`` with a ``MambaPool``, ``MHATokenToKVPool``,
``SWAKVPool``, ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` / ``SWATokenToKVPoolAllocator``)
twice, one set for SGLang's own tree and one for the plugin, and replays the same seeded call sequence
(match, lock, allocate with eviction, insert, free duplicates, keep some locks open across later
evictions, explicit window and state evictions) against both:

- ``full``: ``RadixCache`` vs ``HybridKVRadixCache``, page sizes 1 and 4;
- ``swa``: ``UnifiedRadixCache(FULL, SWA)`` vs ``HybridKVRadixCache(swa=True)``;
- ``mamba``: ``UnifiedRadixCache(FULL, MAMBA)`` vs ``HybridKVRadixCache(mamba=True)``
  (``swa_mamba``: both, ``UnifiedRadixCache(FULL, SWA, MAMBA)``, in the scheduler replay only);
- ``plugin``: the entry point found by SGLang's ``load_plugins`` (a dist-info holding the entry point
  ``pyproject.toml`` declares), ``create_tree_cache`` with ``--radix-cache-backend hybridkv`` for a
  hybrid-SSM context;
- ``bad_input``: the errors the plugin gives for wrong calls;
- ``checkpoint`` (full attention, vs ``RadixCache``), ``checkpoint_swa`` / ``checkpoint_mamba`` (vs
  ``UnifiedRadixCache``): the scheduler's write-back with real ``Req`` objects and SGLang's own
  ``release_kv_cache``: chunked prefill, finish, SWA branch recovery, Mamba copy-on-write (with and
  without a free slot); per step hits, protected length, the request's row, pools and sizes;
- ``sched_*``: seeded requests through the scheduler's calls (admit with copy-on-write, chunked
  ``checkpoint_kv_cache``, ``release_kv_cache``) on FULL + MAMBA, FULL + SWA (page sizes 1 and 4) and
  FULL + SWA + MAMBA;
- ``alloc_ps1`` / ``alloc_ps4`` / ``alloc_bad_input`` / ``alloc_hook`` (``sglang_allocator_replay.py``):
  hybridkv's token-to-KV allocator against SGLang's own, and ``full_ps4_hkalloc``: the ``full_ps4`` cache
  replay with the plugin over hybridkv's allocator.

Per step the report records both sides' match length, evicted counts per component and allocator
free sizes; the plugin's ``check()`` (tree invariants, id-map bijection) runs after every step.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import tomllib
import traceback
from array import array
from pathlib import Path
from typing import Any

import torch
from sglang_allocator_replay import (
    allocator_bad_input,
    allocator_no_device_read,
    allocator_replay,
    allocator_sizes,
    attempt,
    hook_section,
)

ROOT = Path(__file__).resolve().parents[2]


def _sglang() -> dict[str, Any]:
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return {
        "PagedTokenToKVPoolAllocator": PagedTokenToKVPoolAllocator,
        "TokenToKVPoolAllocator": TokenToKVPoolAllocator,
        "SWATokenToKVPoolAllocator": SWATokenToKVPoolAllocator,
        "EvictParams": EvictParams,
        "InsertParams": InsertParams,
        "MatchPrefixParams": MatchPrefixParams,
        "CacheInitParams": CacheInitParams,
        "HybridReqToTokenPool": HybridReqToTokenPool,
        "MHATokenToKVPool": MHATokenToKVPool,
        "ReqToTokenPool": ReqToTokenPool,
        "RadixCache": RadixCache,
        "RadixKey": RadixKey,
        "SWAKVPool": SWAKVPool,
        "ComponentType": ComponentType,
        "UnifiedRadixCache": UnifiedRadixCache,
    }


def _server_args(**kw: Any) -> None:
    """SGLang's caches read process-wide server args (the Mamba component its checkpoint grid)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="hybridkv-parity-dummy", device="cpu", **kw)
    args._mamba_cache_chunk_size = 1  # what SGLang's own fixtures pre-seed: no model config is loaded
    runtime_context._CONTEXT.set_server_args(args)


class Side:
    """One tree over its own real SGLang pools."""

    def __init__(
        self,
        kind: str,
        plugin: bool,
        ps: int,
        size: int,
        swa_size: int,
        window: int,
        slots: int,
        hk_alloc: bool = False,
    ):
        S = _sglang()
        self.S = S
        self.kind = kind
        self.swa = kind in ("swa", "swa_mamba")
        self.mamba = kind in ("mamba", "swa_mamba")
        self.ps = ps
        self.r2t: Any
        if self.mamba:
            from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape

            shape = Mamba2StateShape.create(
                tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=2, head_dim=4, state_size=4, conv_kernel=2
            )
            self.r2t = S["HybridReqToTokenPool"](
                size=8,
                mamba_size=slots,
                mamba_spec_state_size=0,
                max_context_len=128,
                device="cpu",
                enable_memory_saver=False,
                cache_params=Mamba2CacheParams(shape=shape, layers=[1]),
                mamba_layer_ids=[1],
                enable_mamba_extra_buffer=False,
            )
        else:
            self.r2t = S["ReqToTokenPool"](8, 128, "cpu", False)
        if self.swa:
            kv = S["SWAKVPool"](size, swa_size, ps, torch.float16, 1, 8, [1], [0], "cpu")
            self.alloc = S["SWATokenToKVPoolAllocator"](size, swa_size, ps, torch.float16, "cpu", kv, False)
        else:
            kv = S["MHATokenToKVPool"](size, ps, torch.float16, 1, 8, 1, "cpu", False)
            if hk_alloc:  # hybridkv's token-to-KV allocator in place of SGLang's
                from hybridkv.integrations.sglang.allocator import HybridKVTokenToKVPoolAllocator

                self.alloc = HybridKVTokenToKVPoolAllocator(size, ps, torch.float16, "cpu", kv, False)
            elif ps == 1:
                self.alloc = S["TokenToKVPoolAllocator"](size, torch.float16, "cpu", kv, False)
            else:
                self.alloc = S["PagedTokenToKVPoolAllocator"](size, ps, torch.float16, "cpu", kv, False)
        CT = S["ComponentType"]
        comps = {
            "full": (CT.FULL,),
            "swa": (CT.FULL, CT.SWA),
            "mamba": (CT.FULL, CT.MAMBA),
            "swa_mamba": (CT.FULL, CT.SWA, CT.MAMBA),
        }[kind]
        params = S["CacheInitParams"](
            disable=False,
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.alloc,
            page_size=ps,
            sliding_window_size=window if self.swa else None,
            tree_components=comps,
        )
        if plugin:
            from hybridkv.integrations.sglang.radix_cache import HybridKVRadixCache

            self.cache: Any = HybridKVRadixCache(params, swa=self.swa, mamba=self.mamba)
        elif kind == "full":
            self.cache = S["RadixCache"](params)
        else:
            self.cache = S["UnifiedRadixCache"](params)
        self.plugin = plugin
        self.legacy = type(self.cache).__name__ == "RadixCache"

    def key(self, toks: list[int]) -> Any:
        return self.S["RadixKey"](array("q", toks))

    def match(self, toks: list[int]) -> Any:
        return self.cache.match_prefix(self.S["MatchPrefixParams"](key=self.key(toks)))

    def evict(self, tokens: int = 0, swa: int = 0, mamba: int = 0) -> tuple[int, int, int]:
        r = self.cache.evict(self.S["EvictParams"](num_tokens=tokens, swa_num_tokens=swa, mamba_num=mamba))
        return r.num_tokens_evicted, r.swa_num_tokens_evicted, r.mamba_num_evicted

    def free_sizes(self) -> list[int]:
        a = self.alloc
        out = [int(a.full_available_size() if self.swa else a.available_size())]
        if self.swa:
            out.append(int(a.swa_available_size()))
        if self.mamba:
            out.append(int(self.r2t.mamba_allocator.available_size()))
        return out

    def drain(self) -> tuple[int, int, int]:
        """Evict everything unlocked, every component: the one eviction whose victims do not depend on
        the policy's order, so both trees stay equal and every later step compares exactly."""
        big = 10**6
        return self.evict(tokens=big, swa=big if self.swa else 0, mamba=big if self.mamba else 0)

    def alloc_tokens(self, n: int, log: list) -> torch.Tensor | None:
        """``n`` locations (whole pages); short, the tree is drained (memory pressure) and it is tried again."""
        need = -(-n // self.ps) * self.ps
        for _ in range(2):
            got = self.alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
            if got is not None:
                return got
            log.append(self.drain())
        return None

    def alloc_slot(self, log: list) -> torch.Tensor | None:
        for _ in range(2):
            got = self.r2t.mamba_allocator.alloc(1)
            if got is not None:
                return got
            log.append(self.drain())
        return None

    def check(self) -> None:
        if self.plugin:
            self.cache.check()


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Shared heads, branches off them, some exact repeats."""
    heads = [[rng.randrange(1000) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    out: list[list[int]] = []
    for _ in range(n):
        r = rng.random()
        if out and r < 0.2:
            out.append(list(rng.choice(out)))
            continue
        head = rng.choice(heads)
        cut = rng.randrange(0, len(head) + 1)
        out.append(head[:cut] + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))])
    return out


def replay(
    kind: str,
    ps: int,
    seed: int,
    steps: int,
    *,
    size: int,
    swa_size: int = 0,
    window: int = 0,
    slots: int = 0,
    hk_alloc: bool = False,
):
    """The same call sequence on SGLang's tree and the plugin; one row per step. ``hk_alloc``: the plugin
    over hybridkv's token-to-KV allocator (its memory verified after every step)."""
    rng = random.Random(seed)
    sides = [Side(kind, p, ps, size, swa_size, window, slots, hk_alloc=p and hk_alloc) for p in (False, True)]
    prompts = _prompts(rng, steps)
    held: list[list[tuple[Any, Any]]] = []  # per open request: (side's node) for each side
    rows = []
    for step, toks in enumerate(prompts):
        row: dict[str, Any] = {"step": step, "len": len(toks)}
        action = rng.random()
        if kind in ("swa", "mamba") and action < 0.15 and step >= 4:
            # every unlocked window (SWA expiry) or state: what each tree keeps of full KV differs (the
            # report names it), so probe hits right after, then drain both to compare exactly again
            row["op"] = "evict_all_windows" if kind == "swa" else "evict_all_states"
            ask = {"swa": 10**6} if kind == "swa" else {"mamba": 10**6}
            row["evicted"] = [s.evict(**ask) for s in sides]
            row["probes"] = [[s.match(p).device_prefix_len for s in sides] for p in rng.sample(prompts[:step], 4)]
            row["resync"] = [s.drain() for s in sides]
        elif action < 0.2:
            row["op"] = "drain"
            row["evicted"] = [s.drain() for s in sides]
        if held and rng.random() < 0.35:
            for side, lock in zip(sides, held.pop(rng.randrange(len(held))), strict=True):
                side.cache.unlock(lock)
        matches = [s.match(toks) for s in sides]
        row["match"] = [m.device_prefix_len for m in matches]
        row["full_match"] = [getattr(m, "full_kv_hit_length", 0) for m in matches]
        row["branch"] = [m.mamba_branching_seqlen if kind == "mamba" else None for m in matches]
        logs: list[list] = [[], []]
        new_nodes = []
        ok = True
        for i, (side, m) in enumerate(zip(sides, matches, strict=True)):
            node = m.last_device_node
            match_lock = side.cache.lock(node)
            row.setdefault("protected_at_alloc", []).append(int(side.cache.protected_size()))
            pre = m.device_prefix_len
            prefix = side.cache.path_device_indices(node)[:pre]
            new = side.alloc_tokens(len(toks) - pre, logs[i])
            slot = side.alloc_slot(logs[i]) if kind == "mamba" else None
            if new is None or (kind == "mamba" and slot is None):
                ok = False
                if new is not None and new.numel():
                    side.alloc.free(new)
                if slot is not None:
                    side.r2t.mamba_allocator.free(slot)
                side.cache.unlock(match_lock)
                new_nodes.append(None)
                continue
            value = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
            n = len(toks) // ps * ps
            params = side.S["InsertParams"](
                key=side.key(toks[:n]), value=value[:n], mamba_value=slot, prev_prefix_len=pre
            )
            res = side.cache.insert(params)
            if res.prefix_len > pre and side.legacy:  # RadixCache leaves the caller's duplicates to it
                side.alloc.free(value[pre : res.prefix_len])
            if value.numel() > n:
                side.alloc.free(value[n:])
            if slot is not None and res.mamba_exist:
                side.r2t.mamba_allocator.free(slot)
            if rng.random() < 0.3 and res.last_device_node is not None:
                new_nodes.append(side.cache.lock(res.last_device_node))
            else:
                new_nodes.append(None)
            side.cache.unlock(match_lock)
            row.setdefault("prefix_len", []).append(res.prefix_len)
            row.setdefault("mamba_exist", []).append(bool(res.mamba_exist))
        # the same random draws on both sides: a lock kept on one is kept on the other
        if all(n is not None for n in new_nodes):
            held.append(new_nodes)
        else:
            for side, lock in zip(sides, new_nodes, strict=True):
                if lock is not None:
                    side.cache.unlock(lock)
        row["ok"] = ok
        row["evict_for_alloc"] = logs
        row["free"] = [s.free_sizes() for s in sides]
        row["evictable"] = [int(s.cache.evictable_size()) for s in sides]
        row["protected"] = [int(s.cache.protected_size()) for s in sides]
        if kind == "swa":
            row["swa_evictable"] = [int(s.cache.swa_evictable_size()) for s in sides]
        sides[1].check()
        if hk_alloc:
            sides[1].alloc.mem.verify()
        rows.append(row)
    for locks in held:
        for side, lock in zip(sides, locks, strict=True):
            side.cache.unlock(lock)
    drained = [s.evict(tokens=10**6) for s in sides]
    sides[1].check()
    return {"rows": rows, "drained": drained, "final_free": [s.free_sizes() for s in sides], "size": size}


def plugin_section(tmp: Path) -> dict[str, Any]:
    """SGLang's plugin loader finds the declared entry point; create_tree_cache builds the plugin."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    dist = tmp / "hybridkv-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hybridkv\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items())
    )
    sys.path.insert(0, str(tmp))
    import importlib.metadata

    importlib.metadata.distributions.cache_clear() if hasattr(importlib.metadata.distributions, "cache_clear") else None
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    before = registered_radix_cache_backends()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    after = registered_radix_cache_backends()

    _server_args(radix_cache_backend="hybridkv")
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

    side = Side("mamba", False, 1, 64, 0, 0, 4)  # pools only; the cache comes from create_tree_cache
    S = side.S
    params = S["CacheInitParams"](
        disable=False, req_to_token_pool=side.r2t, token_to_kv_pool_allocator=side.alloc, page_size=1
    )
    ctx = TreeCacheBuildContext(
        server_args=None,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=True,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    cache = create_tree_cache(ctx)
    # the cache it built serves one request: insert with a state, then a hit at the state
    slot = side.r2t.mamba_allocator.alloc(1)
    locs = side.alloc.alloc(6)
    cache.insert(S["InsertParams"](key=side.key([5, 6, 7, 8, 9, 10]), value=locs, mamba_value=slot))
    hit = cache.match_prefix(S["MatchPrefixParams"](key=side.key([5, 6, 7, 8, 9, 10, 11]))).device_prefix_len
    miss = cache.match_prefix(S["MatchPrefixParams"](key=side.key([5, 6, 7, 8, 11]))).device_prefix_len
    return {
        "declared": declared,
        "before": before,
        "after": after,
        "type": type(cache).__module__ + "." + type(cache).__qualname__,
        "supports_mamba": cache.supports_mamba(),
        "hit_at_state": hit,
        "hit_without_state": miss,
    }


def swa_recover_section() -> dict[str, Any]:
    """A locked 24-token prefix whose windows behind its last window expired; its first 12 tokens inserted
    again with fresh locations. hybridkv takes the new window pages onto the cached full KV (window
    adoption) and frees only the new full part, so the 12-token hit comes back; SGLang never lost it (its
    lock kept the whole node's window). Afterwards both hold the same and no location leaks."""
    out: dict[str, Any] = {}
    for name, plugin in (("sglang", False), ("plugin", True)):
        side = Side("swa", plugin, 1, 128, 64, 8, 0)
        toks = list(range(100, 124))
        side.cache.insert(side.S["InsertParams"](key=side.key(toks), value=side.alloc.alloc(24)))
        lock = side.cache.lock(side.match(toks).last_device_node)
        expired = side.evict(swa=10**6)
        hit1 = side.match([*toks[:12], 1]).device_prefix_len
        m = side.match(toks[:12])
        head = side.cache.path_device_indices(m.last_device_node)[: m.device_prefix_len]
        value = torch.cat([head, side.alloc.alloc(12 - m.device_prefix_len)])
        params = side.S["InsertParams"](key=side.key(toks[:12]), value=value, prev_prefix_len=m.device_prefix_len)
        res = side.cache.insert(params)
        hit2 = side.match([*toks[:12], 1]).device_prefix_len
        held = side.free_sizes()
        side.cache.unlock(lock)
        drained = side.drain()
        side.check()
        out[name] = {
            "hit_after_expiry": hit1,
            "hit_after_insert": hit2,
            "expired": expired,
            "prefix_len": res.prefix_len,
            "free_while_locked": held,
            "drained": drained,
            "free": side.free_sizes(),
            "adopted": int(side.cache.tree.counters.adopted_pages) if plugin else None,
        }
    return out


def checkpoint_section() -> dict[str, Any]:
    """The scheduler's write-back, ``checkpoint(req, up_to)``, with real ``Req`` objects and a real
    ``ReqToTokenPool`` row: two requests sharing 12 tokens (page size 4), on ``RadixCache`` and the plugin.
    Per request: the prefix it matched, ``cache_protected_len`` after, free tokens, evictable and protected
    sizes, and whether its row now reads the tree's locations for the cached part."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    out: dict[str, Any] = {}
    for name, plugin in (("sglang", False), ("plugin", True)):
        side = Side("full", plugin, 4, 128, 0, 0, 0)
        c = side.cache
        rows = []
        reqs = []
        # both requests match and compute before either writes back (they run in one batch): b's first 12
        # tokens are its own copies, which a's write-back makes duplicates; b's checkpoint must free them
        # and repoint its row at the tree's
        for rid, ids in (("a", list(range(50, 70))), ("b", [*range(50, 62), 7, 7, 7, 7, 7, 7, 7, 7, 7])):
            req = Req(rid, "", array("q", ids), SamplingParams())
            (req.kv.req_pool_idx,) = side.r2t.alloc([req])
            m = side.match(ids)
            pre = m.device_prefix_len
            req.last_node = m.last_device_node
            req.lock = c.lock(m.last_device_node)
            req.kv.cache_protected_len = pre
            head = c.path_device_indices(m.last_device_node)[:pre]
            new = side.alloc.alloc(-(-(len(ids) - pre) // 4) * 4)[: len(ids) - pre]
            side.r2t.write((req.kv.req_pool_idx, slice(0, len(ids))), torch.cat([head, new]).to(torch.int32))
            req.full_untruncated_fill_ids = array("q", ids)
            reqs.append((req, ids, pre))
        for req, ids, pre in reqs:
            c.checkpoint(req, up_to=len(ids))
            cached = req.kv.cache_protected_len
            row = side.r2t.req_to_token[req.kv.req_pool_idx, :cached].to(torch.int64)
            rows.append(
                {
                    "matched": pre,
                    "protected_len": cached,
                    "free": side.free_sizes(),
                    "evictable": int(c.evictable_size()),
                    "protected": int(c.protected_size()),
                    "row_reads_tree": bool(torch.equal(row, c.path_device_indices(req.last_node))),
                }
            )
        for req, _, _ in reqs:
            c.unlock(req.lock)
        if plugin:
            c.check()
        out[name] = rows
    return out


def _hybrid_req(side: Side, rid: str, ids: list[int]) -> Any:
    """A real ``Req`` as the scheduler holds it before its first forward."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", ids), SamplingParams())
    req.full_untruncated_fill_ids = array("q", ids)
    return req


def _admit(side: Side, req: Any, ids: list[int], *, cow: bool) -> dict[str, Any]:
    """What the scheduler does on admission: match (with copy-on-write of a cached Mamba state into the
    request's own slot), take a row (``HybridReqToTokenPool.alloc`` keeps the slot the match gave),
    lock the hit, allocate the rest and write the row; then the forward's copy-on-write itself
    (``ScheduleBatch`` copies ``mamba_cow_src_index`` into the request's slot)."""
    S, c = side.S, side.cache
    m = c.match_prefix(S["MatchPrefixParams"](key=side.key(ids), cow_mamba=cow, req=req))
    out: dict[str, Any] = {"match": m.device_prefix_len, "full_match": m.full_kv_hit_length}
    (req.kv.req_pool_idx,) = side.r2t.alloc([req])
    pre = m.device_prefix_len
    req.last_node = m.last_device_node
    req.lock = c.lock(m.last_device_node)
    if side.mamba:  # the states locks hold, this request's hit's included
        out["mamba_protected"] = int(c.mamba_protected_size())
    req.kv.cache_protected_len = pre
    req.swa_branching_seqlen = m.swa_branching_seqlen  # as the scheduler's match helper copies it
    out["swa_branching"] = m.swa_branching_seqlen
    head = c.path_device_indices(m.last_device_node)[:pre]
    if side.ps == 1:
        new = side.alloc.alloc(len(ids) - pre)
    else:  # SGLang's paged SWA allocator hands out pages only through alloc_extend
        last = head[-1:].to(torch.int64) if pre else torch.tensor([-1], dtype=torch.int64)
        lens = (torch.tensor([pre], dtype=torch.int64), torch.tensor([len(ids)], dtype=torch.int64))
        new = side.alloc.alloc_extend(lens[0], lens[0], lens[1], lens[1], last, len(ids) - pre)
    side.r2t.write((req.kv.req_pool_idx, slice(0, len(ids))), torch.cat([head, new]).to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = len(ids)
    if side.mamba:
        temporal = side.r2t.mamba_pool.mamba_cache.temporal
        src = req.kv.mamba_cow_src_index
        out["cow_state"] = None if src is None else float(temporal[0, int(src[0])].flatten()[0])
        if src is not None:
            side.r2t.mamba_pool.copy_from(src, req.kv.mamba_pool_idx.reshape(1))
            req.kv.mamba_cow_src_index = None
        # the request's slot after the copy (without one it holds stale state the forward clears)
        out["req_state"] = None if src is None else float(temporal[0, int(req.kv.mamba_pool_idx)].flatten()[0])
    return out


def _forward(side: Side, req: Any, upto: int) -> None:
    """The request computed its first ``upto`` tokens: its Mamba slot holds the state after them
    (a value naming the length, so a copy of it is recognisable)."""
    req.extend_end = upto
    if side.mamba:
        side.r2t.mamba_pool.mamba_cache.temporal[:, int(req.kv.mamba_pool_idx)] = float(upto)


def _observe(side: Side, req: Any, what: str) -> dict[str, Any]:
    c = side.cache
    cached = int(req.kv.cache_protected_len)
    row = side.r2t.req_to_token[req.kv.req_pool_idx, :cached].to(torch.int64) if req.kv.holds_kv else None
    out: dict[str, Any] = {
        "what": what,
        "protected_len": cached,
        "free": side.free_sizes(),
        "evictable": int(c.evictable_size()),
        "protected": int(c.protected_size()),
        "row_reads_tree": None if row is None else bool(torch.equal(row, c.path_device_indices(req.last_node))),
        "row": side.r2t.req_to_token[req.kv.req_pool_idx, : len(req.full_untruncated_fill_ids)].tolist(),
    }
    if side.swa:
        out["swa_evictable"] = int(c.swa_evictable_size())
        out["swa_protected"] = int(c.swa_protected_size())
        out["swa_evicted_seqlen"] = int(req.kv.component_evicted_seqlens.get(side.S["ComponentType"].SWA, 0))
        out["branching_after"] = req.swa_branching_seqlen
    if side.mamba:
        out["holds_mamba"] = req.kv.holds_mamba
        out["mamba_evictable"] = int(c.mamba_evictable_size())
    side.check()
    return out


def hybrid_checkpoint_section(kind: str, ps: int = 1, window: int = 4) -> dict[str, Any]:
    # ps: page size (SWA only: SGLang's Mamba component needs 1); window: SWA window in tokens
    """The scheduler's write-back on a hybrid model, with real ``Req`` objects, SGLang's own
    ``checkpoint_kv_cache`` (a running request's chunk, ``up_to = extend_end``) and ``release_kv_cache``
    (finish) and pools, against ``UnifiedRadixCache(FULL, SWA / MAMBA)``:

    - ``a``: a 24-token prompt in two chunks: ``checkpoint(up_to=12)`` unfinished (SWA: frees its own
      window slots behind its window first; Mamba: the tree gets a copy of the state), then finished and
      released through ``release_kv_cache`` (Mamba: the slot itself goes to the tree);
    - ``b``: a's first 6 tokens (SWA: their windows were freed, so the hit is 0 and the match names a
      branch at 6: the first checkpoint inserts only up to there and restores that hit) plus 10 new;
      Mamba: a's first 12 + 8 new, a hit at a's state at 12, copied into b's slot (copy-on-write);
    - ``c``: a's whole 24 + 4: a hit on a's donated state (Mamba), checkpointed unfinished at 28, then
      finished at the same length (the tree holds a state there: the request's slot is freed);
    - probes of the hits after, then every lock dropped and the tree drained.
    """
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

    rng = random.Random(7)
    a_ids = [rng.randrange(1000) for _ in range(24)]
    b_ids = [*a_ids[:12], *(rng.randrange(1000) for _ in range(8))]
    if kind == "swa":
        b_ids = [*a_ids[:6], *(rng.randrange(1000) for _ in range(10))]
    c_ids = [*a_ids, *(rng.randrange(1000) for _ in range(4))]
    out: dict[str, Any] = {}
    for name, plugin in (("sglang", False), ("plugin", True)):
        side = Side(kind, plugin, ps, 128, 64, window, 6)
        steps: list[dict[str, Any]] = []
        cow = kind == "mamba"

        def finish(req: Any, side: Side = side, steps: list = steps) -> None:
            req.finished_reason = FINISH_LENGTH(0)
            release_kv_cache(req, side.cache, checkpoint=True)
            steps.append(
                {
                    "what": f"{req.rid} released",
                    "free": side.free_sizes(),
                    "holds_mamba": req.kv.holds_mamba,
                    "evictable": int(side.cache.evictable_size()),
                }
            )
            side.check()

        def checkpointed(
            rid: str, ids: list[int], upto: int, label: str, side: Side = side, steps: list = steps, cow: bool = cow
        ) -> Any:
            """Request ``rid`` admitted, computed to ``upto`` and checkpointed there (step ``rid checkpoint
            label``)."""
            req = _hybrid_req(side, rid, ids)
            steps.append({"what": f"{rid} admitted", **_admit(side, req, ids, cow=cow)})
            _forward(side, req, upto)
            checkpoint_kv_cache(req, side.cache)
            steps.append(_observe(side, req, f"{rid} checkpoint {label}"))
            return req

        a = checkpointed("a", a_ids, 12, "12")
        _forward(side, a, 24)
        finish(a)

        b = checkpointed("b", b_ids, len(b_ids), "all (unfinished)")
        if kind == "swa":  # the branch was inserted first: the rest goes in with the next checkpoint
            checkpoint_kv_cache(b, side.cache)
            steps.append(_observe(side, b, "b checkpoint all again"))
        finish(b)

        finish(checkpointed("c", c_ids, len(c_ids), "all (unfinished)"))

        probes = {
            "a": side.match(a_ids).device_prefix_len,
            "a12": side.match(a_ids[:12]).device_prefix_len,
            "b": side.match(b_ids).device_prefix_len,
            "c": side.match(c_ids).device_prefix_len,
        }
        if kind == "mamba":
            # copy-on-write with no free slot: the match evicts one cached state for the request's slot,
            # never the one it is about to copy (locked meanwhile)
            taken = side.r2t.mamba_allocator.alloc(side.r2t.mamba_allocator.available_size())
            d = _hybrid_req(side, "d", c_ids)
            steps.append({"what": "d admitted, no slot free", **_admit(side, d, c_ids, cow=True)})
            steps[-1]["probes"] = [side.match(p).device_prefix_len for p in (a_ids[:12], b_ids, a_ids, c_ids)]
            _forward(side, d, len(c_ids))
            finish(d)
            side.r2t.mamba_allocator.free(taken)
            errors = _hybrid_errors(side, a_ids, "cow_without_req")  # a hit with a state: there is one to copy
        drained = side.drain()
        side.check()
        out[name] = {"steps": steps, "probes": probes, "drained": drained, "free": side.free_sizes()}
        if kind == "mamba":
            out[name]["checkpoint_evicts"] = _checkpoint_evicts_state(side, rng)
        if kind == "mamba":  # last: SGLang's own tree leaks a lock, then a Mamba slot, on these
            out[name]["errors"] = {
                **errors,
                **_cow_without_slot(side, rng),
                **_hybrid_errors(side, a_ids, "checkpoint_released_req"),
                **_checkpoint_short(side, rng),
            }
    return out


def scheduler_replay(kind: str, seed: int, steps: int, ps: int = 1) -> dict[str, Any]:
    """Seeded requests through the scheduler's calls (shared heads, branches, repeats), one at a time or two
    running together: admit (match with copy-on-write, row, lock, allocate; drained first when the pools
    are short, with no request running, so both trees drain exactly), running-request write-backs
    (``checkpoint_kv_cache`` at random chunk ends; two requests' interleaved, so one writes back a prefix
    the other computed too and must free its own copies), finish (``release_kv_cache``). Per request and
    side: hit, full hit, branch, copied state, protected length after each write-back, whether the row
    reads the tree, pools and evictable size after its release."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

    rng = random.Random(seed)
    prompts = _prompts(rng, steps)
    # the plan, drawn before either side runs: groups of one or two requests, each with its chunk ends,
    # and the order of the group's write-backs and finishes (each request's own in order)
    plan: list[tuple[list[int], list[tuple[int, int | None]]]] = []
    cuts = [sorted(rng.sample(range(1, len(t)), min(len(t) - 1, rng.randrange(0, 3)))) for t in prompts]
    i = 0
    while i < len(prompts):
        pair = i + 1 < len(prompts) and rng.random() >= 0.5
        fits = pair and len(prompts[i]) + len(prompts[i + 1]) + 8 <= 96  # both in the smallest pool (SWA)
        members = [i, i + 1] if fits else [i]
        queues = [[(m, c) for c in cuts[m]] + [(m, None)] for m in members]
        order: list[tuple[int, int | None]] = []
        while any(queues):
            q = rng.choice([q for q in queues if q])
            order.append(q.pop(0))
        plan.append((members, order))
        i += len(members)
    out: dict[str, Any] = {}
    for name, plugin in (("sglang", False), ("plugin", True)):
        side = Side(kind, plugin, ps, 160, 96, 8, 16)
        rows: dict[int, dict[str, Any]] = {}
        for members, order in plan:
            need = sum(-(-len(prompts[m]) // ps) * ps + ps for m in members)
            free = side.free_sizes()
            short = free[0] < need or (side.swa and free[1] < need)
            # Mamba: each request's slot and one copy per running write-back, so no write-back evicts a
            # state (SGLang would drop the leaf's full KV with it: the difference the insert replay names)
            if short or (side.mamba and free[-1] < sum(2 + len(cuts[m]) for m in members)):
                rows[members[0]] = {"drained": side.drain()}
            reqs = {}
            for m in members:
                req = reqs[m] = _hybrid_req(side, f"r{m}", prompts[m])
                row = rows.setdefault(m, {})
                row.update({"step": m, "len": len(prompts[m]), "group": len(members)})
                row.update(_admit(side, req, prompts[m], cow=side.mamba))
                row["protected"] = []
                row["reads_tree"] = []
            for m, cut in order:
                req, row = reqs[m], rows[m]
                if cut is None:
                    _forward(side, req, len(prompts[m]))
                    req.finished_reason = FINISH_LENGTH(0)
                    release_kv_cache(req, side.cache, checkpoint=True)
                    row["free"] = side.free_sizes()
                    row["evictable"] = int(side.cache.evictable_size())
                elif cut > row["match"]:
                    _forward(side, req, cut)
                    checkpoint_kv_cache(req, side.cache)
                    cached = int(req.kv.cache_protected_len)
                    row["protected"].append(cached)
                    got = side.r2t.req_to_token[req.kv.req_pool_idx, :cached].to(torch.int64)
                    row["reads_tree"].append(bool(torch.equal(got, side.cache.path_device_indices(req.last_node))))
                side.check()
            rows[members[-1]]["idle"] = _idle_census(side)
        out[name] = {"rows": [rows[m] for m in range(len(prompts))], "drained": side.drain(), "free": side.free_sizes()}
        if plugin:  # the caller's copies of tokens the tree held already (freed by checkpoint's insert)
            out[name]["duplicate_pages"] = int(side.cache.tree.counters.duplicate_pages)
        side.check()
    return out


def _idle_census(side: Side) -> dict[str, Any]:
    """What SGLang's scheduler checks when idle (``InvariantChecker._check_all_pools``): per pool
    free + evictable + protected == capacity, with the tree's own size calls; and its leak census
    (``all_values_flatten`` / ``all_mamba_values_flatten`` and the free lists cover every id once)."""
    c, a = side.cache, side.alloc
    out: dict[str, Any] = {}
    if side.swa:
        out["full"] = [int(a.full_available_size()), c.full_evictable_size(), c.full_protected_size(), a.size_full]
        out["swa"] = [int(a.swa_available_size()), c.swa_evictable_size(), c.swa_protected_size(), a.size_swa]
    else:
        out["full"] = [int(a.available_size()), c.full_evictable_size(), c.full_protected_size(), a.size]
    if side.mamba:
        m = side.r2t.mamba_allocator
        out["mamba"] = [int(m.available_size()), c.mamba_evictable_size(), c.mamba_protected_size(), m.size]
        cached = sorted(c.all_mamba_values_flatten().tolist())
        free = sorted(m.free_slots.tolist())
        out["mamba_census"] = len(cached) + len(free) == m.size and set(cached) | set(free) == set(range(1, m.size + 1))
    if not side.swa:
        cached_locs = c.all_values_flatten().tolist()
        free_locs = a.get_all_free_pages().tolist() if side.ps == 1 else []
        if side.ps == 1:
            out["full_census"] = sorted(cached_locs + free_locs) == list(range(1, a.size + 1))
    return {k: [int(x) for x in v] if isinstance(v, list) else v for k, v in out.items()}


def _checkpoint_evicts_state(side: Side, rng: random.Random) -> dict[str, Any]:
    """A running request's write-back with no Mamba slot free for the state's copy: one cached state (the
    only one, unlocked: both trees must pick it) is evicted for it."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

    old = [rng.randrange(1000) for _ in range(8)]
    first = _hybrid_req(side, "f1", old)
    _admit(side, first, old, cow=True)
    _forward(side, first, len(old))
    first.finished_reason = FINISH_LENGTH(0)
    release_kv_cache(first, side.cache, checkpoint=True)
    ids = [rng.randrange(1000) for _ in range(10)]
    run = _hybrid_req(side, "f2", ids)
    _admit(side, run, ids, cow=True)
    taken = side.r2t.mamba_allocator.alloc(side.r2t.mamba_allocator.available_size())
    before = side.free_sizes()
    _forward(side, run, 5)
    checkpoint_kv_cache(run, side.cache)
    out: dict[str, Any] = {
        "before": before,
        "after": side.free_sizes(),
        "protected_len": int(run.kv.cache_protected_len),
        "hit_old": side.match(old).device_prefix_len,
        "full_old": side.match(old).full_kv_hit_length,
        "hit_new": side.match(ids[:5]).device_prefix_len,
    }
    side.r2t.mamba_allocator.free(taken)
    _forward(side, run, len(ids))
    run.finished_reason = FINISH_LENGTH(0)
    release_kv_cache(run, side.cache, checkpoint=True)
    out["drained"] = side.drain()
    out["free"] = side.free_sizes()
    side.check()
    return out


def _checkpoint_short(side: Side, rng: random.Random) -> dict[str, Any]:
    """A write-back shorter than what the request matched (``up_to < cache_protected_len``): refused before
    the tree changes, the state copy made for it given back; then the request finishes normally."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    ids = [rng.randrange(1000) for _ in range(12)]
    first = _hybrid_req(side, "g1", ids)
    _admit(side, first, ids, cow=True)
    _forward(side, first, len(ids))
    first.finished_reason = FINISH_LENGTH(0)
    release_kv_cache(first, side.cache, checkpoint=True)
    req = _hybrid_req(side, "g2", [*ids, 5, 6])
    hit = _admit(side, req, [*ids, 5, 6], cow=True)["match"]
    before = side.free_sizes()
    out: dict[str, Any] = {"short_hit": hit}
    attempt(out, "checkpoint_short", lambda: side.cache.checkpoint(req, up_to=4))
    out["short_free_kept"] = side.free_sizes() == before
    if side.plugin:  # SGLang's tree asserted after its insert: only the plugin's side is finished cleanly
        _forward(side, req, len(ids) + 2)
        req.finished_reason = FINISH_LENGTH(0)
        release_kv_cache(req, side.cache, checkpoint=True)
        side.drain()
        side.check()
        out["short_free_after"] = side.free_sizes()
    return out


def _cow_without_slot(side: Side, rng: random.Random) -> dict[str, Any]:
    """Copy-on-write with no slot free and the matched state the only one cached: the match must not
    evict the state it is about to copy (both refuse); the state is still there after."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    ids = [rng.randrange(1000) for _ in range(8)]
    first = _hybrid_req(side, "e1", ids)
    _admit(side, first, ids, cow=True)
    _forward(side, first, len(ids))
    first.finished_reason = FINISH_LENGTH(0)
    release_kv_cache(first, side.cache, checkpoint=True)
    taken = side.r2t.mamba_allocator.alloc(side.r2t.mamba_allocator.available_size())
    second = _hybrid_req(side, "e2", [*ids, 1, 2])
    out: dict[str, Any] = {}
    params = side.S["MatchPrefixParams"](key=side.key([*ids, 1, 2]), cow_mamba=True, req=second)
    attempt(out, "cow_no_slot", lambda: side.cache.match_prefix(params))
    out["cow_no_slot_state_kept"] = side.match(ids).device_prefix_len == len(ids)
    side.r2t.mamba_allocator.free(taken)
    return out


def _hybrid_errors(side: Side, ids: list[int], which: str) -> dict[str, str]:
    """A wrong write-back / copy-on-write call and the error each side gives."""
    out: dict[str, str] = {}
    S = side.S

    if which == "cow_without_req":
        attempt(out, which, lambda: side.cache.match_prefix(S["MatchPrefixParams"](key=side.key(ids), cow_mamba=True)))
    else:
        released = _hybrid_req(side, "released", ids)
        attempt(out, which, lambda: side.cache.checkpoint(released, up_to=4))
    return out


def bad_input_section() -> dict[str, str]:
    """Each wrong call and the error it gives (class: message)."""
    side = Side("full", True, 1, 64, 0, 0, 0)
    other = Side("full", True, 1, 64, 0, 0, 0)
    S, c = side.S, side.cache
    locs = side.alloc.alloc(4)
    node = c.insert(S["InsertParams"](key=side.key([1, 2, 3, 4]), value=locs)).last_device_node
    other_node = other.cache.insert(
        S["InsertParams"](key=other.key([1, 2, 3, 4]), value=other.alloc.alloc(4))
    ).last_device_node
    out: dict[str, str] = {}

    attempt(out, "key_not_radixkey", lambda: c.match_prefix(S["MatchPrefixParams"](key=[1, 2, 3])))
    attempt(out, "token_ids_of_strings", lambda: c.match_prefix(S["MatchPrefixParams"](key=S["RadixKey"](["a", "b"]))))
    attempt(
        out,
        "float_value",
        lambda: c.insert(S["InsertParams"](key=side.key([9, 9]), value=torch.tensor([1.0, 2.0]))),
    )
    attempt(
        out,
        "value_too_short",
        lambda: c.insert(S["InsertParams"](key=side.key([9, 9, 9]), value=torch.tensor([5]))),
    )
    attempt(
        out,
        "location_out_of_range",
        lambda: c.insert(S["InsertParams"](key=side.key([7, 7]), value=torch.tensor([10**6, 10**6 + 1]))),
    )
    attempt(out, "lock_other_cache_node", lambda: c.inc_lock_ref(other_node))
    attempt(out, "lock_not_a_node", lambda: c.inc_lock_ref("node-7"))
    c.inc_lock_ref(node)
    c.dec_lock_ref(node)
    attempt(out, "double_unlock", lambda: c.dec_lock_ref(node))
    c.evict(S["EvictParams"](num_tokens=100))
    attempt(out, "lock_evicted_node", lambda: c.inc_lock_ref(node))
    out["tree_still_valid"] = "yes"
    c.check()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    t0 = time.perf_counter()
    report: dict[str, Any] = {}
    _server_args()
    report["full_ps1"] = replay("full", 1, seed=1, steps=args.steps, size=160)
    report["full_ps4"] = replay("full", 4, seed=2, steps=args.steps, size=160)
    report["full_ps4_hkalloc"] = replay("full", 4, seed=2, steps=args.steps, size=160, hk_alloc=True)
    t = time.perf_counter()
    report["alloc_ps1"] = allocator_replay(1, seed=21, steps=200, size=96)
    report["alloc_ps4"] = allocator_replay(4, seed=22, steps=200, size=160)
    report["alloc_bad_input"] = allocator_bad_input()
    report["alloc_no_device_read"] = allocator_no_device_read()
    report["alloc_sizes"] = allocator_sizes()
    report["alloc_seconds"] = time.perf_counter() - t
    report["swa"] = replay("swa", 1, seed=3, steps=args.steps, size=200, swa_size=96, window=8)
    report["mamba"] = replay("mamba", 1, seed=4, steps=args.steps, size=200, slots=6)
    report["swa_recover"] = swa_recover_section()
    report["checkpoint"] = checkpoint_section()
    report["checkpoint_swa"] = hybrid_checkpoint_section("swa")
    report["checkpoint_swa_ps4"] = hybrid_checkpoint_section("swa", ps=4)
    for name, kind, seed, ps in (
        ("sched_mamba", "mamba", 11, 1),
        ("sched_swa", "swa", 13, 1),
        ("sched_swa_ps4", "swa", 14, 4),
        ("sched_swa_mamba", "swa_mamba", 16, 1),
    ):
        t = time.perf_counter()
        report[name] = scheduler_replay(kind, seed=seed, steps=100, ps=ps)
        report[name]["seconds"] = time.perf_counter() - t
    report["checkpoint_mamba"] = hybrid_checkpoint_section("mamba")
    report["bad_input"] = bad_input_section()
    with tempfile.TemporaryDirectory() as tmp:
        report["plugin"] = plugin_section(Path(tmp))
    report["alloc_hook"] = hook_section()
    report["seconds"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
