"""``hybridkv bench cache``: the ``radix`` replay protocol of the peer trace through the
prefix cache, side by side with a simple page-hash prefix cache in the same run.

Protocol (hybridkv/traces/data/README.md), strictly one request at a time: ``match(input)``
-> lock the match (``KVManager.admit``) -> allocate the new tokens, evicting what the
allocator reports short (``KVManager.extend``) -> ``insert(input + output)`` (page-aligned;
duplicates freed) -> unlock: free the unaligned tail and give the lock back
(``KVManager.release``). Hit rate = sum of matched tokens / sum of input tokens. The page
tables are flushed once per request, as an engine does once per step. Timed ops: ``match``,
``lock/unlock`` (admit + release, the tail's free included), ``insert`` (with the frees of
duplicates), ``evict`` (each eviction an allocation needed).

Configurations: ``full`` (Llama-3.1-8B, full attention only) and ``full+swa``
(Gemma-3-27B-IT: full attention + SWA with window 1024), each on a tables-only (``meta``)
arena sized to hold N tokens in every KV pool at once: N = 300,000, or "unbounded" (every
token the trace can ever cache: the system prompts plus every request's new tokens).
The exact-hit-rate check (0.8862) runs the unbounded ``full`` configuration at page size 1.

Baseline: ``PageHashCache``, vLLM-style prefix caching: one dict entry per page keyed by
the chained hash of its tokens, match walks page by page, LRU over leaf pages; same
memory, same protocol, full KV only (it frees whole pages, never window pages). Ops/s are
reported for both, with the ratio, from the least disturbed of ``repeat`` passes.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hybridkv.cache import PAGE_NEED, HybridRadixCache, KVHandle, KVManager, MatchResult
from hybridkv.host_sync import HostSyncCounter
from hybridkv.memory import MemoryHints, OutOfMemory, UnifiedMemory, build_layouts, plan_memory
from hybridkv.spec import IdSpace, PoolId, ShardSpec, get_preset
from hybridkv.traces import PEER_TRACE, load_peer_trace

CONFIGS = {"full": "Llama-3.1-8B", "full+swa": "Gemma-3-27B-IT"}
POOL_TOKENS = 300_000
HIT_RATE_GOAL = 0.8862
GOALS = {"match_ops_full_ps16": 58_000, "insert_ops_full_swa": 15_000}
MAX_CONTEXT = 8192
OPS = ("match", "lock/unlock", "insert", "evict")


# --- the trace -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RadixRequest:
    input: np.ndarray
    sequence: np.ndarray
    """Input + output tokens (what is inserted)."""


def radix_requests(trace: dict[str, Any]) -> list[RadixRequest]:
    """Token sequences of the ``radix`` part, in order (turn k extends turn k-1's sequence)."""
    part = trace["radix"]
    prompts = part["system_prompts"]
    seq_of: dict[int, list[int]] = {}
    out = []
    for r in part["requests"]:
        if r["turn"] == 0:
            tokens = prompts[r["sys_id"]] + r["user_ids"]
        else:
            if r["prev_rid"] not in seq_of:
                raise ValueError(f"radix request {r['rid']}: previous turn {r['prev_rid']} comes later")
            tokens = seq_of[r["prev_rid"]] + r["user_ids"]
        seq = tokens + r["output_ids"]
        seq_of[r["rid"]] = seq
        out.append(RadixRequest(np.asarray(tokens, dtype=np.int64), np.asarray(seq, dtype=np.int64)))
    return out


def cacheable_tokens(trace: dict[str, Any]) -> int:
    """Every token the radix part can put in a cache: system prompts + each request's new tokens."""
    part = trace["radix"]
    new = sum(len(r["user_ids"]) + len(r["output_ids"]) for r in part["requests"])
    return sum(len(p) for p in part["system_prompts"]) + new


# --- memory sized in tokens ---------------------------------------------------------------


def memory_for_tokens(model: str, tokens: int, page_size: int) -> UnifiedMemory:
    """A tables-only arena holding ``tokens`` tokens in every KV pool at once (plus slab edges)."""
    shard = ShardSpec.whole(get_preset(model))
    layouts = build_layouts(shard, page_size)
    largest = max(lay.cell_bytes for lay in layouts)
    pages = math.ceil(tokens / page_size) + math.ceil(MAX_CONTEXT / page_size)
    slab = largest * max(2, min(64, pages // 64))
    slabs = sum(math.ceil(pages / (slab // lay.cell_bytes - 1)) for lay in layouts)
    budget = largest + slabs * slab
    hints = MemoryHints(page_size=page_size, max_context=MAX_CONTEXT, chunk_tokens=MAX_CONTEXT, slab_bytes=slab)
    return UnifiedMemory(plan_memory(shard, budget, hints), device="meta")


# --- the two caches under test ------------------------------------------------------------


class BenchCache(Protocol):
    evict_ns: list[int]
    """Time of each eviction an allocation needed."""

    @property
    def evicted(self) -> int:
        """Pages freed whole by eviction."""

    def match(self, tokens: np.ndarray) -> tuple[int, object]: ...
    def lock(self, hit: object) -> object: ...
    def alloc(self, handle: object, tokens: int) -> None:
        """Grow the request to ``tokens`` tokens, evicting as the allocator needs."""

    def insert(self, handle: object, tokens: np.ndarray) -> None: ...
    def unlock(self, handle: object) -> None:
        """Free the request's pages the cache did not take (the tail), give its lock back."""


class _TimedManager(KVManager):
    """The manager, with each eviction timed."""

    def __init__(self, cache: HybridRadixCache):
        super().__init__(cache)
        self.evict_ns: list[int] = []
        self.evicted = 0

    def evict(self, needs: Mapping[PoolId | IdSpace, int]) -> dict[PoolId | IdSpace, int]:
        t0 = time.perf_counter_ns()
        freed = super().evict(needs)
        self.evict_ns.append(time.perf_counter_ns() - t0)
        self.evicted += freed.get(PAGE_NEED, 0)
        return freed


class HybridBench:
    """hybridkv: ``KVManager`` over ``HybridRadixCache``, one ``KVHandle`` per request."""

    def __init__(self, mem: UnifiedMemory):
        self.kvm = _TimedManager(HybridRadixCache(mem))
        self.evict_ns = self.kvm.evict_ns

    @property
    def evicted(self) -> int:
        return self.kvm.evicted

    def match(self, tokens: np.ndarray) -> tuple[int, object]:
        m = self.kvm.match(tokens)
        return m.length, m

    def lock(self, hit: object) -> object:
        assert isinstance(hit, MatchResult)
        return self.kvm.admit(hit)

    def alloc(self, handle: object, tokens: int) -> None:
        assert isinstance(handle, KVHandle)
        self.kvm.extend(handle, tokens)

    def insert(self, handle: object, tokens: np.ndarray) -> None:
        assert isinstance(handle, KVHandle)
        self.kvm.insert(handle, tokens, final=True)

    def unlock(self, handle: object) -> None:
        assert isinstance(handle, KVHandle)
        self.kvm.release(handle)


class PageHashCache:
    """Baseline: a dict of pages keyed by chained hashes; LRU eviction of unreferenced leaf pages.

    A hit touches every page it covers; a page whose last child goes becomes a leaf with the
    recency of its own last use (a lazy heap of ``(last use, hash)``).
    """

    def __init__(self, mem: UnifiedMemory):
        self.mem = mem
        self.ps = mem.page_size
        self.pages: dict[int, list[int]] = {}  # hash -> [page, parent hash, children, refs, last use]
        self.heap: list[tuple[int, int]] = []  # (last use, hash) of leaves, lazily stale
        self.tick = 0
        self.evict_ns: list[int] = []
        self.evicted = 0

    def match(self, tokens: np.ndarray) -> tuple[int, object]:
        buf, step, h = tokens.tobytes(), self.ps * 8, 0
        self.tick += 1
        path, pages = [], []
        for off in range(0, len(buf) - step + 1, step):
            h = hash((h, buf[off : off + step]))
            entry = self.pages.get(h)
            if entry is None:
                break
            entry[4] = self.tick
            path.append(h)
            pages.append(entry[0])
        if path and self.pages[path[-1]][2] == 0:
            heapq.heappush(self.heap, (self.tick, path[-1]))
        return len(path) * self.ps, _PageHashRequest(path, np.asarray(pages, dtype=np.int64))

    def lock(self, hit: object) -> object:
        assert isinstance(hit, _PageHashRequest)
        for h in hit.path:
            self.pages[h][3] += 1
        return hit

    def alloc(self, handle: object, tokens: int) -> None:
        assert isinstance(handle, _PageHashRequest)
        need = -(-tokens // self.ps) - handle.row.size
        while True:
            try:
                fresh = self.mem.alloc_pages(need)
                break
            except OutOfMemory as exc:
                t0 = time.perf_counter_ns()
                pages = self.evict(exc.short)
                self.evict_ns.append(time.perf_counter_ns() - t0)
                if not pages:
                    raise
                self.evicted += pages
        handle.row = np.concatenate([handle.row, fresh])

    def unlock(self, handle: object) -> None:
        assert isinstance(handle, _PageHashRequest)
        if handle.row.size > handle.aligned:
            self.mem.free_pages(handle.row[handle.aligned :])
        for h in handle.path:
            self.pages[h][3] -= 1

    def insert(self, handle: object, tokens: np.ndarray) -> None:
        assert isinstance(handle, _PageHashRequest)
        handle.aligned = aligned = tokens.size // self.ps
        pages = handle.row
        buf, step, h, parent = tokens[: aligned * self.ps].tobytes(), self.ps * 8, 0, 0
        self.tick += 1
        dups = []
        for i, off in enumerate(range(0, len(buf) - step + 1, step)):
            h = hash((h, buf[off : off + step]))
            entry = self.pages.get(h)
            if entry is None:
                self.pages[h] = [int(pages[i]), parent, 0, 0, self.tick]
                if parent:
                    self.pages[parent][2] += 1
            else:
                entry[4] = self.tick
                if entry[0] != pages[i]:
                    dups.append(int(pages[i]))
            parent = h
        if parent and self.pages[parent][2] == 0:
            heapq.heappush(self.heap, (self.tick, parent))
        if dups:
            self.mem.free_pages(np.asarray(dups, dtype=np.int64))

    def evict(self, short: dict[PoolId | IdSpace, int]) -> int:
        """Free at least the largest shortage in whole pages; returns pages freed."""
        need = max(short.values())
        freed: list[int] = []
        skipped = []
        while len(freed) < need and self.heap:
            tick, h = heapq.heappop(self.heap)
            entry = self.pages.get(h)
            if entry is None or entry[2] or entry[4] != tick:
                continue  # gone, not a leaf any more, or touched since (a newer entry exists)
            if entry[3]:
                skipped.append((tick, h))
                continue
            del self.pages[h]
            freed.append(entry[0])
            parent = entry[1]
            if parent:
                up = self.pages[parent]
                up[2] -= 1
                if up[2] == 0:
                    heapq.heappush(self.heap, (up[4], parent))
        for item in skipped:
            heapq.heappush(self.heap, item)
        if freed:
            self.mem.free_pages(np.asarray(freed, dtype=np.int64))
        return len(freed)


@dataclass
class _PageHashRequest:
    path: list[int]
    """Hashes of the hit's pages (what its lock holds)."""
    row: np.ndarray
    aligned: int = 0
    """Pages the insert covered (the rest is the request's tail)."""


# --- the replay ---------------------------------------------------------------------------


@dataclass
class RunResult:
    matched: int = 0
    inputs: int = 0
    evicted: int = 0
    op_ns: dict[str, list[int]] = field(default_factory=lambda: {op: [] for op in OPS})
    wall_s: float = 0.0
    host_syncs: int = 0

    def summary(self) -> dict[str, Any]:
        ops = {}
        for op, samples in self.op_ns.items():
            arr = np.asarray(samples, dtype=np.float64)
            ops[op] = {
                "calls": int(arr.size),
                "ops_per_s": float(arr.size / (arr.sum() / 1e9)) if arr.size else 0.0,
                "p50_us": float(np.percentile(arr, 50) / 1e3) if arr.size else 0.0,
                "p99_us": float(np.percentile(arr, 99) / 1e3) if arr.size else 0.0,
            }
        return {
            "hit_rate": self.matched / self.inputs if self.inputs else 0.0,
            "matched_tokens": self.matched,
            "input_tokens": self.inputs,
            "evicted_pages": self.evicted,
            "wall_s": self.wall_s,
            "host_syncs": self.host_syncs,
            "ops": ops,
        }


def replay(requests: list[RadixRequest], mem: UnifiedMemory, cache: BenchCache) -> RunResult:
    res = RunResult()
    clock = time.perf_counter_ns
    t_start = time.perf_counter()
    with HostSyncCounter() as syncs:
        for req in requests:
            t0 = clock()
            length, hit = cache.match(req.input)
            t1 = clock()
            handle = cache.lock(hit)
            t2 = clock()
            res.op_ns["match"].append(t1 - t0)
            res.matched += length
            res.inputs += req.input.size
            cache.alloc(handle, req.sequence.size)
            t0 = clock()
            cache.insert(handle, req.sequence)
            res.op_ns["insert"].append(clock() - t0)
            t3 = clock()
            cache.unlock(handle)
            res.op_ns["lock/unlock"].append(t2 - t1 + clock() - t3)
            mem.flush_tables()
    res.wall_s = time.perf_counter() - t_start
    res.host_syncs = syncs.total
    res.op_ns["evict"] = list(cache.evict_ns)
    res.evicted = cache.evicted
    return res


def run_one(
    requests: list[RadixRequest],
    model: str,
    pool_tokens: int,
    page_size: int,
    impl: Callable[[UnifiedMemory], BenchCache],
    repeat: int = 1,
) -> dict[str, Any]:
    """``repeat`` fresh passes; the one with the least time in cache calls is reported (the
    machine may be shared: the fastest pass is the least disturbed one). Every pass must
    give the same hit rate."""
    best: RunResult | None = None
    for _ in range(max(1, repeat)):
        mem = memory_for_tokens(model, pool_tokens, page_size)
        res = replay(requests, mem, impl(mem))
        if best is not None and (res.matched, res.evicted) != (best.matched, best.evicted):
            raise AssertionError(f"{model}: passes disagree ({res.matched} vs {best.matched} tokens hit)")
        if best is None or sum(map(sum, res.op_ns.values())) < sum(map(sum, best.op_ns.values())):
            best = res
    assert best is not None
    out = best.summary()
    out["budget_bytes"] = mem.arena.nbytes
    out["passes"] = max(1, repeat)
    return out


def run(
    trace_path: str = PEER_TRACE, page_size: int = 16, configs: list[str] | None = None, repeat: int = 3
) -> dict[str, Any]:
    trace = load_peer_trace(trace_path)
    requests = radix_requests(trace)
    unbounded = cacheable_tokens(trace)
    report: dict[str, Any] = {
        "trace": trace_path,
        "requests": len(requests),
        "page_size": page_size,
        "unbounded_tokens": unbounded,
        "runs": [],
    }
    for name in configs or list(CONFIGS):
        if name not in CONFIGS:
            raise ValueError(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
        for pool, tokens in (("unbounded", unbounded), (str(POOL_TOKENS), POOL_TOKENS)):
            for impl_name, impl in (("hybridkv", HybridBench), ("page_hash_baseline", PageHashCache)):
                row = run_one(requests, CONFIGS[name], tokens, page_size, impl, repeat)
                row.update(config=name, model=CONFIGS[name], pool=pool, pool_tokens=tokens, impl=impl_name)
                report["runs"].append(row)
    exact = run_one(requests, CONFIGS["full"], unbounded, 1, HybridBench)
    exact_base = run_one(requests, CONFIGS["full"], unbounded, 1, PageHashCache)
    report["exact_hit_rate"] = {
        "page_size": 1,
        "hybridkv": exact["hit_rate"],
        "page_hash_baseline": exact_base["hit_rate"],
        "goal": HIT_RATE_GOAL,
        "met": round(exact["hit_rate"], 4) == HIT_RATE_GOAL and exact["hit_rate"] == exact_base["hit_rate"],
    }
    report["ratios"] = _ratios(report["runs"])
    report["goals"] = _goals(report)
    return report


def _ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    base = {(r["config"], r["pool"]): r for r in runs if r["impl"] == "page_hash_baseline"}
    for r in runs:
        if r["impl"] != "hybridkv":
            continue
        b = base[(r["config"], r["pool"])]
        out.append(
            {
                "config": r["config"],
                "pool": r["pool"],
                **{
                    op: (r["ops"][op]["ops_per_s"] / b["ops"][op]["ops_per_s"]) if b["ops"][op]["ops_per_s"] else None
                    for op in OPS
                },
            }
        )
    return out


def _goals(report: dict[str, Any]) -> dict[str, Any]:
    runs = [r for r in report["runs"] if r["impl"] == "hybridkv"]
    goals: dict[str, Any] = {}
    full = [r for r in runs if r["config"] == "full"]
    if full and report["page_size"] == 16:
        worst = min(r["ops"]["match"]["ops_per_s"] for r in full)
        goals["full match ops/s at page size 16"] = {
            "value": worst,
            "goal": GOALS["match_ops_full_ps16"],
            "met": worst >= GOALS["match_ops_full_ps16"],
        }
    swa = [r for r in runs if r["config"] == "full+swa"]
    if swa:
        worst = min(r["ops"]["insert"]["ops_per_s"] for r in swa)
        goals["full+swa insert ops/s"] = {
            "value": worst,
            "goal": GOALS["insert_ops_full_swa"],
            "met": worst >= GOALS["insert_ops_full_swa"],
        }
    exact = report["exact_hit_rate"]
    goals["unbounded hit rate at page size 1"] = {
        "value": exact["hybridkv"],
        "goal": HIT_RATE_GOAL,
        "met": exact["met"],
    }
    return goals
