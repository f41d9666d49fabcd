"""Eviction policies, chosen by name: which cached value goes first when a pool is short.

Each policy orders candidates of one component (a history pool for full-KV leaves, a window
pool for SWA residency, ``"state"`` for checkpoints); the smallest key is evicted first.

- ``lru`` (default): least recently used.
- ``lfu``: fewest hits, then least recently used.
- ``priority``: lowest request priority, then least recently used.
- ``cost``: cost-aware, GreedyDual-Size-Frequency: ``key = clock + hits * recompute / bytes``;
  the clock rises to each evicted key, so unused entries age out. ``recompute`` is the
  prefill work the entry saves (``RecomputeCost``): full attention grows with position, SWA
  with ``min(position, window)``, every layer pays a constant per token; a state
  checkpoint saves the whole recurrent prefix back to the previous checkpoint on its path.

Invariant: a key depends only on the node's fields and the policy's own clock, so the tree
can rank candidates at eviction time without keeping heaps up to date on every hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.spec import ShardSpec

if TYPE_CHECKING:
    from hybridkv.cache.components import Components
    from hybridkv.cache.eviction import Need
    from hybridkv.cache.node import Node

ATTENTION_TOKENS_PER_UNIT = 4096
"""Attention over this many earlier tokens costs as much as one layer's per-token work."""


class RecomputeCost:
    """Relative prefill cost of tokens ``[a, b)`` of one sequence on one shard."""

    def __init__(self, shard: ShardSpec):
        self.layers = len(shard.layers)  # every layer pays its per-token work
        self.full = 0
        self.windows: list[int] = []
        for layer in shard.layers:
            kind = shard.local_kind(layer.layer_id)
            pool = kind.pool_id
            if pool is not None and pool.keeps_history:
                self.full += 1
            elif pool is not None and pool.releases_history and pool.max_span is not None:
                self.windows.append(pool.max_span)

    def __call__(self, a: int, b: int) -> float:
        if b <= a:
            return 0.0
        attention = self.full * (_tri(b) - _tri(a))
        for w in self.windows:
            attention += _capped(b, w) - _capped(a, w)
        return self.layers * (b - a) + attention / ATTENTION_TOKENS_PER_UNIT


def _tri(x: int) -> int:
    """Sum of positions ``0 .. x-1``."""
    return x * (x - 1) // 2


def _capped(x: int, w: int) -> int:
    """Sum of ``min(p, w)`` over positions ``0 .. x-1``."""
    return _tri(x) if x <= w else _tri(w) + (x - w) * w


class Policy:
    name = "base"

    def bind(self, components: Components, cost: RecomputeCost) -> None:
        """Called once by the tree that uses this policy."""

    def touched(self, node: Node) -> None:
        """A hit or an insert used ``node``."""

    def evicted(self, key: object) -> None:
        """The entry with ``key`` was evicted."""

    def key(self, node: Node, component: Need) -> object:
        raise NotImplementedError


class LRU(Policy):
    name = "lru"

    def key(self, node: Node, component: Need) -> object:
        return node.last_access


class LFU(Policy):
    name = "lfu"

    def key(self, node: Node, component: Need) -> object:
        return (node.hits, node.last_access)


class PriorityPolicy(Policy):
    name = "priority"

    def key(self, node: Node, component: Need) -> object:
        return (node.priority, node.last_access)


class CostAware(Policy):
    name = "cost"

    def __init__(self) -> None:
        self.clock = 0.0
        self._components: Components | None = None
        self._cost: RecomputeCost | None = None

    def bind(self, components: Components, cost: RecomputeCost) -> None:
        self._components, self._cost = components, cost

    def touched(self, node: Node) -> None:
        node.clock = self.clock

    def evicted(self, key: object) -> None:
        self.clock = max(self.clock, float(key))  # type: ignore[arg-type]

    def key(self, node: Node, component: Need) -> float:
        comps, cost = self._components, self._cost
        if comps is None or cost is None:
            raise RuntimeError("cost policy used before a cache bound it (HybridRadixCache does)")
        if component == comps.state:
            prev = node.parent
            while prev is not None and prev.parent is not None and prev.state < 0:
                prev = prev.parent
            start = prev.end if prev is not None and prev.parent is not None else 0
            saved, nbytes = cost(start, node.end), comps.state_bytes
        elif component in comps.history:
            saved = cost(node.start, node.end)
            nbytes = node.pages.size * comps.history_page_bytes
            nbytes += sum(n * w.cell_bytes for n, w in zip(node.swa_res, comps.windows, strict=True))
            nbytes += comps.state_bytes if node.state >= 0 else 0
        else:
            w = next(w for w in comps.windows if w.pool_id == component)
            saved, nbytes = cost(node.start, node.end), node.swa_res[w.index] * w.cell_bytes
        return node.clock + max(1, node.hits) * saved / max(1, nbytes)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (LRU, LFU, PriorityPolicy, CostAware)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
