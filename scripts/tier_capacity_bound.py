"""How much prefix hit a given cache capacity allows at best, counting full-attention KV bytes only.

    .venv/bin/python scripts/tier_capacity_bound.py [--model Gemma-3-27B-IT] [--limit 4000] [--gib 592,1104,2128]

The Mooncake conversation trace names its prompts by 512-token blocks whose ids already name
their whole prefix. This replays the first ``--limit`` requests in arrival order over a cache
of whole blocks, each costing the model's full-attention KV of 512 tokens (sliding windows,
recurrent state, outputs and timing are left out, so every figure is an upper bound on what
``hybridkv replay`` can reach with that many bytes of device + host memory), and prints, per
capacity, the hit rate (hit tokens over prompt tokens; a hit is the longest run of leading
blocks present) of:
- ``lru``: evict the least recently used block, a prompt's tail before its head (a radix cache's
  leaves first: what the device, host and store tiers do);
- ``lfuda``: evict the block of least frequency plus age (LFU with dynamic aging: the age is the
  priority of the last block evicted), a policy that keeps blocks many prompts share;
- ``belady``: evict the block used again farthest in the future (offline optimal per block:
  a bound no online policy can beat without knowing the future);
- ``unbounded``: nothing evicted.
One JSON object.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import Counter, OrderedDict

from hybridkv.spec.presets import PresetError, get_preset
from hybridkv.traces import MOONCAKE_BLOCK_TOKENS, MooncakeRequest, load_mooncake_trace

NEVER = 1 << 62


def hit_tokens(request: MooncakeRequest, present: dict[int, object]) -> int:
    """Tokens of the longest run of ``request``'s leading blocks found in ``present``."""
    blocks = 0
    while blocks < len(request.hash_ids) and request.hash_ids[blocks] in present:
        blocks += 1
    return min(blocks * MOONCAKE_BLOCK_TOKENS, request.input_length)


def lru_hits(requests: list[MooncakeRequest], capacity_blocks: int) -> int:
    cache: OrderedDict[int, object] = OrderedDict()
    hits = 0
    for request in requests:
        hits += hit_tokens(request, cache)
        for block in reversed(request.hash_ids):  # a prompt's head last: its tail blocks leave first
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits


def lfuda_hits(requests: list[MooncakeRequest], capacity_blocks: int) -> int:
    priority: dict[int, object] = {}  # block -> its priority (age when last used + its uses)
    uses: Counter[int] = Counter()
    lowest: list[tuple[float, int]] = []  # (priority, block), stale entries skipped
    hits, age = 0, 0.0
    for request in requests:
        hits += hit_tokens(request, priority)
        for block in request.hash_ids:
            uses[block] += 1
            priority[block] = age + uses[block]
            heapq.heappush(lowest, (age + uses[block], block))
        while len(priority) > capacity_blocks:
            value, block = heapq.heappop(lowest)
            if priority.get(block) == value:
                del priority[block]
                age = value
    return hits


def belady_hits(requests: list[MooncakeRequest], capacity_blocks: int) -> int:
    accesses = [block for request in requests for block in request.hash_ids]
    next_use = [NEVER] * len(accesses)
    seen: dict[int, int] = {}
    for t in range(len(accesses) - 1, -1, -1):
        next_use[t] = seen.get(accesses[t], NEVER)
        seen[accesses[t]] = t
    cache: dict[int, object] = {}  # block -> its next use
    farthest: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits, t = 0, 0
    for request in requests:
        hits += hit_tokens(request, cache)
        for block in request.hash_ids:
            cache[block] = next_use[t]
            heapq.heappush(farthest, (-next_use[t], block))
            t += 1
        while len(cache) > capacity_blocks:
            use, block = heapq.heappop(farthest)
            if cache.get(block) == -use:
                del cache[block]
    return hits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Gemma-3-27B-IT")
    ap.add_argument("--limit", type=int, default=4000)
    ap.add_argument("--gib", default="592,1104,2128", help="comma list of capacities in GiB")
    args = ap.parse_args()
    try:
        spec = get_preset(args.model)
        capacities = [int(g) for g in args.gib.split(",")]
    except (PresetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.limit < 1 or any(g < 1 for g in capacities):
        print("error: --limit and every --gib must be >= 1", file=sys.stderr)
        return 2
    block_bytes = MOONCAKE_BLOCK_TOKENS * spec.kv_bytes_per_token("full")
    if block_bytes == 0:
        print(f"error: {spec.name} has no full-attention KV: nothing for this bound to count", file=sys.stderr)
        return 2
    requests = load_mooncake_trace(limit=args.limit)
    prompt = sum(r.input_length for r in requests)
    rows = []
    for gib in capacities:
        blocks = gib * 2**30 // block_bytes
        rows.append(
            {
                "gib": gib,
                "lru": round(lru_hits(requests, blocks) / prompt, 4),
                "lfuda": round(lfuda_hits(requests, blocks) / prompt, 4),
                "belady": round(belady_hits(requests, blocks) / prompt, 4),
            }
        )
    unbounded = round(lru_hits(requests, NEVER) / prompt, 4)
    out = {"model": spec.name, "requests": len(requests), "block_bytes": block_bytes, "unbounded": unbounded}
    print(json.dumps({**out, "capacities": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
