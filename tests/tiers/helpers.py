"""Tiny hybrid memories with real bytes, requests served through the cache, byte snapshots."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from hybridkv.cache import HybridRadixCache, KVManager
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import ModelSpec, Parallel, ShardSpec, from_hf_config

TINY = ("tiny-qwen3-next", "tiny-gemma3")


@cache
def tiny_spec(name: str) -> ModelSpec:
    """The spec of the engine's tiny random model ``name`` (its Hugging Face config)."""
    from transformers import AutoConfig

    from hybridkv.engine.random_models import TINY_CONFIGS

    model_type, overrides = TINY_CONFIGS[name]
    return from_hf_config(AutoConfig.for_model(model_type, **overrides), name=name, kv_dtype="float32")


def tiny_memory(name: str, budget: int = 400_000, page_size: int = 4, tp: int = 1, tp_rank: int = 0) -> UnifiedMemory:
    spec = tiny_spec(name)
    shard = ShardSpec(spec, Parallel(tp_size=tp), 0, tp_rank) if tp > 1 else ShardSpec.whole(spec)
    mem = UnifiedMemory.create(shard, budget, page_size=page_size, max_context=128, chunk_tokens=16)
    gen = torch.Generator().manual_seed(7)
    mem.arena.buffer.copy_(torch.randint(0, 256, mem.arena.buffer.shape, dtype=torch.uint8, generator=gen))
    return mem


def serve(kvm: KVManager, tokens: np.ndarray, fill: int) -> None:
    """One request: match, admit, reserve the placement's checkpoints, 'compute' the rest of
    the prompt (its pages and checkpoints get fresh random bytes), finish."""
    mem = kvm.mem
    match = kvm.match(tokens[:-1])
    kv = kvm.admit(match)
    for at in kvm.checkpoints.wanted(kv, tokens.size):
        kvm.checkpoints.reserve(kv, at)
    kvm.extend(kv, tokens.size)
    gen = torch.Generator().manual_seed(fill)
    for pool in mem.pools.values():
        ids = kv.own_pages() if pool not in mem.slot_pools else np.array(list(kv.checkpoints.values()), np.int64)
        cells = mem.host_cells(ids, pool.pool_id)
        cells = cells[cells >= 0]
        grid = pool.arena.cell_grid(pool.grid_cells, pool.cell_bytes)
        grid[cells] = torch.randint(0, 256, (cells.size, pool.cell_bytes), dtype=torch.uint8, generator=gen)
    kvm.release_windows([kv])
    kvm.finish(kv, tokens)


def view_bytes(mem: UnifiedMemory, pages: np.ndarray, slot: int | None) -> dict[tuple[str, int, str, int], bytes]:
    """The bytes every layer view (``mem.view``) holds for the page at each position of
    ``pages`` and for state ``slot`` (position -1), keyed (pool, layer, tensor, position);
    window pools only where the page is resident."""
    out: dict[tuple[str, int, str, int], bytes] = {}
    for pool in mem.pools.values():
        if pool in mem.slot_pools:
            if slot is None:
                continue
            ids, positions = np.array([slot], dtype=np.int64), [-1]
        else:
            ids, positions = pages, list(range(pages.size))
        cells = mem.host_cells(ids, pool.pool_id)
        for seg in pool.layout.segments:
            view = mem.view(seg.layer_id, seg.tensor)
            for pos, c in zip(positions, cells, strict=True):
                if c >= 0:
                    data = view[int(c)].contiguous().view(torch.uint8).numpy().tobytes()
                    out[(str(pool.pool_id), seg.layer_id, seg.tensor, pos)] = data
    return out


def new_cache(mem: UnifiedMemory, placement: str = "interval:8") -> tuple[HybridRadixCache, KVManager]:
    cache = HybridRadixCache(mem)
    return cache, KVManager(cache, placement)
