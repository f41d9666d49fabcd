"""``hybridkv bench memory``: replay the ``alloc`` part of the peer trace through allocators.

Protocol (hybridkv/traces/data/README.md): a prefill batch is one ``alloc_extend`` (prefix 0) for all its
requests; a decode step one ``alloc_decode`` for every running request in admission order;
a finish frees each request's row with a segment free from position 0 (hybridkv batches a
finish event's frees in one free group; the group's release is timed and counted in the
time, not as calls; the baseline has no groups). With a sliding
window, one batched window free after each step drops SWA pages that left the span the
window pool's history rule keeps (``PoolId.first_needed``); with recurrent state, one state
slot per request is allocated with its prefill batch and freed with its finish. Which of
these a model needs is read from its pools, not from the config name.

Each configuration runs three passes over the same trace: a sizing pass (peak cells per
pool, checked against the trace's published peak), a timed pass of hybridkv and of the
static-pool baseline side by side, and a counted pass of both under ``HostSyncCounter``.
The unified arena is tables-only (``meta``, the default): the allocator's work is the same,
no bytes. With ``device`` ``cpu`` or ``cuda`` the timed and counted passes run on a real arena
and device tables there, and the baseline's tensors live on that device too (the sizing pass
stays tables-only).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from hybridkv.bench.static_pools import StaticAllocator
from hybridkv.host_sync import HostSyncCounter
from hybridkv.memory import MemoryHints, TokenAllocator, UnifiedMemory, plan_memory
from hybridkv.spec import FULL_POOL, RECURRENT_POOL, IdSpace, PoolId, ShardSpec, get_preset
from hybridkv.traces import PEER_TRACE, load_peer_trace

_UNCOUNTED = {"flush_tables", "free_group_enter", "free_group_exit"}

CONFIGS = {
    "full": "Llama-3.1-8B",
    "full+swa": "Gemma-3-27B-IT",
    "full+state": "Qwen3-Next-80B-A3B-Instruct",
}


class Allocator(Protocol):
    def extend(self, prefix: np.ndarray, seq: np.ndarray, last: np.ndarray) -> np.ndarray: ...
    def decode(self, seq: np.ndarray, last: np.ndarray) -> np.ndarray: ...
    def free_row(self, locs: np.ndarray) -> None: ...
    def free_group(self) -> AbstractContextManager[None]: ...
    def free_window(self, pages: np.ndarray) -> None: ...
    def alloc_state(self, count: int) -> np.ndarray: ...
    def free_state(self, slots: np.ndarray) -> None: ...
    def step_done(self) -> None: ...


class UnifiedAllocator:
    def __init__(self, mem: UnifiedMemory):
        self.mem = mem
        self.tokens = TokenAllocator(mem)

    def extend(self, prefix: np.ndarray, seq: np.ndarray, last: np.ndarray) -> np.ndarray:
        return self.tokens.alloc_extend(prefix, seq, last)

    def decode(self, seq: np.ndarray, last: np.ndarray) -> np.ndarray:
        return self.tokens.alloc_decode(seq, last)

    def free_row(self, locs: np.ndarray) -> None:
        self.tokens.free_segment(locs, 0)

    def free_group(self) -> AbstractContextManager[None]:
        return self.mem.free_group()

    def free_window(self, pages: np.ndarray) -> None:
        self.mem.windows.free(pages)

    def alloc_state(self, count: int) -> np.ndarray:
        return self.mem.alloc_state(count)

    def free_state(self, slots: np.ndarray) -> None:
        self.mem.free_state(slots)

    def step_done(self) -> None:
        """Before a forward would run: bring the device page tables up to date."""
        self.mem.flush_tables()


class BaselineAllocator:
    """Adapts the static-pool baseline to host arrays (zero-copy on the CPU; on another device
    its inputs are copied there and its outputs back, as an engine would)."""

    def __init__(self, alloc: StaticAllocator, counter: HostSyncCounter | None, device: str = "cpu"):
        self.alloc = alloc
        self.counter = counter
        self.device = torch.device(device)

    def _in(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(arr).to(self.device)

    def _out(self, tensor: torch.Tensor) -> np.ndarray:
        if self.counter is not None:  # the driver's own conversion is not the allocator's sync
            self.counter.counting = False
            out = tensor.cpu().numpy()
            self.counter.counting = True
            return out
        return tensor.cpu().numpy()

    def extend(self, prefix: np.ndarray, seq: np.ndarray, last: np.ndarray) -> np.ndarray:
        return self._out(self.alloc.alloc_extend(self._in(prefix), self._in(seq), self._in(last)))

    def decode(self, seq: np.ndarray, last: np.ndarray) -> np.ndarray:
        return self._out(self.alloc.alloc_decode(self._in(seq), self._in(last)))

    def free_row(self, locs: np.ndarray) -> None:
        self.alloc.free_segment(self._in(locs))

    def free_group(self) -> AbstractContextManager[None]:
        return nullcontext()

    def free_window(self, pages: np.ndarray) -> None:
        self.alloc.free_window(self._in(pages))

    def alloc_state(self, count: int) -> np.ndarray:
        return self._out(self.alloc.alloc_state(count))

    def free_state(self, slots: np.ndarray) -> None:
        self.alloc.free_state(self._in(slots))

    def step_done(self) -> None:
        """The baseline's tables already live on the device."""


@dataclass
class ReplayResult:
    op_ns: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    wall_s: float = 0.0
    peak: dict[PoolId, int] = field(default_factory=dict)

    @property
    def calls(self) -> int:
        """Allocator calls. Per-step table flushes and free-group brackets are timed (their
        time is in ``call_s``) but not counted as calls."""
        return sum(len(v) for op, v in self.op_ns.items() if op not in _UNCOUNTED)

    @property
    def call_s(self) -> float:
        return sum(sum(v) for v in self.op_ns.values()) / 1e9

    def summary(self) -> dict[str, Any]:
        ops = {
            op: {
                "calls": len(ns),
                "p50_us": float(np.percentile(ns, 50)) / 1e3,
                "p99_us": float(np.percentile(ns, 99)) / 1e3,
            }
            for op, ns in self.op_ns.items()
        }
        return {
            "calls": self.calls,
            "calls_per_s": self.calls / self.call_s if self.call_s else 0.0,
            "time_in_calls_s": self.call_s,
            "wall_s": self.wall_s,
            "ops": ops,
        }


def replay(
    trace: dict[str, Any],
    alloc: Allocator,
    page_size: int,
    window: PoolId | None,
    with_state: bool,
    observe: Callable[[], dict[PoolId, int]] | None = None,
) -> ReplayResult:
    """Drive ``alloc`` through the trace's alloc events; time every allocator call.

    ``window``: the bounded-history pool whose pages are dropped as the span moves on.
    """
    part = trace["alloc"]
    prompt = {r["rid"]: r["prompt_len"] for r in part["requests"]}
    max_len = max(r["prompt_len"] + r["output_len"] for r in part["requests"]) + 1
    max_running = 512
    rows = np.zeros((max_running, max_len), dtype=np.int64)
    lens = np.zeros(max_running, dtype=np.int64)
    swa_freed = np.zeros(max_running, dtype=np.int64)
    state_of = np.zeros(max_running, dtype=np.int64)
    free_rows = list(range(max_running - 1, -1, -1))
    slot_of: dict[int, int] = {}
    running: list[int] = []  # row slots in admission order
    result = ReplayResult()
    record = result.op_ns
    clock = time.perf_counter_ns

    def timed(op: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = clock()
        out = fn(*args)
        record[op].append(clock() - t0)
        if observe is not None:
            for name, value in observe().items():
                result.peak[name] = max(result.peak.get(name, 0), value)
        return out

    def drop_window(slots: np.ndarray) -> None:
        assert window is not None
        first_needed = window.first_needed(lens[slots]) // page_size
        behind = first_needed - swa_freed[slots]
        sel = behind > 0
        if not sel.any():
            return
        s, k = slots[sel], behind[sel]
        if (k == 1).all():
            pages = rows[s, swa_freed[s] * page_size] // page_size
        else:
            pages = (
                np.concatenate(
                    [
                        rows[i, f * page_size : (f + n) * page_size : page_size]
                        for i, f, n in zip(s, swa_freed[s], k, strict=True)
                    ]
                )
                // page_size
            )
        swa_freed[s] = first_needed[sel]
        timed("free_window", alloc.free_window, pages)

    start = time.perf_counter()
    for event in part["events"]:
        op = event["op"]
        if op == "prefill":
            rids = event["rids"]
            seq = np.array([prompt[r] for r in rids], dtype=np.int64)
            zeros = np.zeros_like(seq)
            locs = timed("alloc_extend", alloc.extend, zeros, seq, zeros)
            new = np.array([free_rows.pop() for _ in rids], dtype=np.int64)
            ends = np.cumsum(seq)
            for slot, rid, n, end in zip(new, rids, seq, ends, strict=True):
                rows[slot, :n] = locs[end - n : end]
                slot_of[rid] = int(slot)
            lens[new] = seq
            swa_freed[new] = 0
            running.extend(int(s) for s in new)
            if with_state:
                state_of[new] = timed("alloc_state", alloc.alloc_state, len(rids))
            if window is not None:
                drop_window(new)
        elif op == "decode":
            slots = np.array(running, dtype=np.int64)
            last = rows[slots, lens[slots] - 1]
            out = timed("alloc_decode", alloc.decode, lens[slots] + 1, last)
            rows[slots, lens[slots]] = out
            lens[slots] += 1
            if window is not None:
                drop_window(slots)
        elif op == "finish":
            done = [slot_of.pop(r) for r in event["rids"]]
            group = alloc.free_group()
            timed("free_group_enter", group.__enter__)
            for slot in done:
                timed("free_segment", alloc.free_row, rows[slot, : lens[slot]].copy())
                running.remove(slot)
                free_rows.append(slot)
            timed("free_group_exit", group.__exit__, None, None, None)
            if with_state:
                timed("free_state", alloc.free_state, state_of[np.array(done)])
        else:
            raise ValueError(f"unknown event op {op!r} in the alloc trace")
        timed("flush_tables", alloc.step_done)
    result.wall_s = time.perf_counter() - start
    return result


def _make_memory(model: str, page_size: int, budget: int, device: str = "meta") -> UnifiedMemory:
    shard = ShardSpec.whole(get_preset(model))
    plan = plan_memory(shard, budget, MemoryHints(page_size=page_size, max_context=8192, chunk_tokens=8192))
    return UnifiedMemory(plan, device=device)


def run_config(name: str, trace: dict[str, Any], page_size: int, device: str = "meta") -> dict[str, Any]:
    model = CONFIGS[name]
    shard = ShardSpec.whole(get_preset(model))
    layouts = {
        lay.pool_id: lay
        for lay in plan_memory(shard, 2**38, MemoryHints(page_size=page_size, max_context=8192)).layouts
    }
    windows = [pool for pool in layouts if pool.releases_history]
    if len(windows) > 1 or (set(layouts) - {FULL_POOL, RECURRENT_POOL, *windows}):
        raise ValueError(
            f"{model}: pools {[str(p) for p in layouts]}; the static baseline models one full pool, "
            "at most one window pool and one state pool"
        )
    window = windows[0] if windows else None
    with_state = any(pool.id_space is IdSpace.SLOT for pool in layouts)

    # pass 1: sizing, on a generous arena; the full pool's peak must match the trace's
    sizing = _make_memory(model, page_size, 2**38)
    observe = lambda: {p.pool_id: p.live_count for p in sizing.pools.values()}  # noqa: E731
    peak = replay(trace, UnifiedAllocator(sizing), page_size, window, with_state, observe).peak
    published = trace["alloc"]["peak_live_pages"].get(str(page_size))
    if published is not None and peak[FULL_POOL] != published:
        raise AssertionError(f"replay peak {peak[FULL_POOL]} full pages != trace's {published}: protocol drift")
    cells = {n: math.ceil(1.05 * p) + 2 for n, p in peak.items()}
    exact = sum(cells[n] * layouts[n].cell_bytes for n in cells)
    budget = int(exact * 1.02) + (len(cells) * 3 + 1) * (exact // 500 + max(lay.cell_bytes for lay in layouts.values()))

    results: dict[str, Any] = {
        "model": model,
        "pool_cells": {str(pool): n for pool, n in cells.items()},
        "peak_cells": {str(pool): n for pool, n in peak.items()},
    }
    for counted in (False, True):
        counter = HostSyncCounter() if counted else None
        mem = _make_memory(model, page_size, budget, device)
        base_device = "cpu" if device == "meta" else device
        baseline = StaticAllocator(
            cells[FULL_POOL],
            page_size,
            swa_pages=cells[window] if window is not None else 0,
            state_slots=cells.get(RECURRENT_POOL, 0),
            device=base_device,
        )
        runs: dict[str, Allocator] = {
            "hybridkv": UnifiedAllocator(mem),
            "static_baseline": BaselineAllocator(baseline, counter, base_device),
        }
        for label, allocator in runs.items():
            if counter is None:
                results[label] = replay(trace, allocator, page_size, window, with_state).summary()
            else:
                counter.counts.clear()
                with counter:
                    replay(trace, allocator, page_size, window, with_state)
                results[label]["host_syncs"] = counter.total
                results[label]["host_sync_kinds"] = dict(counter.counts)
        if not counted:
            mem.verify()
            stats = mem.stats()
            results["hybridkv"]["budget_bytes"] = stats.budget_bytes
            results["hybridkv"]["bytes_moved"] = stats.bytes_moved
            results["hybridkv"]["edge_waste_bytes"] = sum(p.edge_waste_bytes for p in stats.pools)
    ours, base = results["hybridkv"]["calls_per_s"], results["static_baseline"]["calls_per_s"]
    results["speedup_vs_baseline"] = ours / base if base else None
    return results


def run(
    trace_path: str = PEER_TRACE, page_size: int = 16, configs: list[str] | None = None, device: str = "meta"
) -> dict[str, Any]:
    """``device``: ``meta`` (tables only), ``cpu`` or ``cuda`` (see the module docstring)."""
    torch.set_num_threads(1)
    trace = load_peer_trace(trace_path)
    chosen = configs or list(CONFIGS)
    unknown = set(chosen) - set(CONFIGS)
    if unknown:
        raise ValueError(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    return {
        "trace": str(trace_path),
        "page_size": page_size,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "configs": {name: run_config(name, trace, page_size, device) for name in chosen},
    }
