"""Eviction policies, chosen by name: which cached value goes first when a pool is short.

Each policy orders candidates of one component, named by its hit rule (``rules.py``: full KV
for whole leaves, a window pool for window residency, the checkpoint rule for recurrent-state
checkpoints); the smallest key is evicted first.

- ``lru`` (default): least recently used.
- ``lfu``: fewest hits, then least recently used.
- ``priority``: lowest request priority, then least recently used.
- ``cost``: cost-aware, GreedyDual-Size-Frequency: ``key = clock + hits * recompute / bytes``;
  the clock rises to each evicted key, so unused entries age out. ``recompute`` is the
  prefill FLOPs the entry saves (``RecomputeCost``), as each layer kind estimates them
  (``LayerKind.recompute_flops_per_token``: attention over the history its pool id's rule
  keeps, a recurrent layer's state update); a state checkpoint saves the whole prefix back
  to the previous checkpoint on its path.

Invariant: a key depends only on the node's fields and the policy's own clock, so the tree
can rank candidates at eviction time without keeping heaps up to date on every hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hybridkv.cache.rules import ComponentKind, WindowRule
from hybridkv.registry import Registry
from hybridkv.spec import LayerKind, ShardSpec

if TYPE_CHECKING:
    from hybridkv.cache.node import Node
    from hybridkv.cache.rules import HitRules, Rule


class RecomputeCost:
    """Prefill work (FLOPs) to rebuild tokens ``[a, b)`` of one sequence on one shard.

    Each layer's kind says what rebuilding one token at a position costs it
    (``LayerKind.recompute_flops_per_token``, from its pool id's history rule); the cost of a
    range is a difference of prefix sums over positions, grown on demand, so a key costs
    O(1) and no kind is special-cased here.
    """

    def __init__(self, shard: ShardSpec):
        kinds: list[LayerKind] = []
        counts: list[int] = []
        for layer in shard.layers:
            kind = shard.local_kind(layer.layer_id)
            if kind in kinds:
                counts[kinds.index(kind)] += 1
            else:
                kinds.append(kind)
                counts.append(1)
        self._kinds = tuple(zip(kinds, counts, strict=True))
        self._prefix = np.zeros(1, dtype=np.float64)
        """``_prefix[p]``: the cost of positions ``[0, p)``."""

    def _grow(self, end: int) -> None:
        have = self._prefix.size - 1
        size = max(end, 2 * have, _MIN_POSITIONS)
        per = [sum(n * kind.recompute_flops_per_token(p) for kind, n in self._kinds) for p in range(have, size)]
        self._prefix = np.concatenate([self._prefix, self._prefix[-1] + np.cumsum(per, dtype=np.float64)])

    def __call__(self, a: int, b: int) -> float:
        if b <= a:
            return 0.0
        if b >= self._prefix.size:
            self._grow(b)
        return float(self._prefix[b] - self._prefix[a])


_MIN_POSITIONS = 1024


class Policy:
    name = "base"

    def bind(self, rules: HitRules, cost: RecomputeCost) -> None:
        """Called once by the cache that uses this policy."""

    def touched(self, node: Node) -> None:
        """A hit or an insert used ``node``."""

    def evicted(self, key: object) -> None:
        """The entry with ``key`` was evicted."""

    def key(self, node: Node, component: Rule) -> object:
        raise NotImplementedError


class LRU(Policy):
    name = "lru"

    def key(self, node: Node, component: Rule) -> object:
        return node.last_access


class LFU(Policy):
    name = "lfu"

    def key(self, node: Node, component: Rule) -> object:
        return (node.hits, node.last_access)


class PriorityPolicy(Policy):
    name = "priority"

    def key(self, node: Node, component: Rule) -> object:
        return (node.priority, node.last_access)


class CostAware(Policy):
    name = "cost"

    def __init__(self) -> None:
        self.clock = 0.0
        self._rules: HitRules | None = None
        self._cost: RecomputeCost | None = None

    def bind(self, rules: HitRules, cost: RecomputeCost) -> None:
        self._rules, self._cost = rules, cost

    def touched(self, node: Node) -> None:
        node.clock = self.clock

    def evicted(self, key: object) -> None:
        self.clock = max(self.clock, float(key))  # type: ignore[arg-type]

    def key(self, node: Node, component: Rule) -> float:
        rules, cost = self._rules, self._cost
        if rules is None or cost is None:
            raise RuntimeError("cost policy used before a cache bound it (HybridRadixCache does)")
        checkpoint_bytes = rules.checkpoint.cell_bytes if rules.checkpoint is not None else 0
        if component.kind is ComponentKind.CHECKPOINT:
            prev = node.parent
            while prev is not None and prev.parent is not None and prev.checkpoint < 0:
                prev = prev.parent
            start = prev.end if prev is not None and prev.parent is not None else 0
            saved, nbytes = cost(start, node.end), checkpoint_bytes
        elif component.kind is ComponentKind.FULL_KV:
            saved = cost(node.start, node.end)
            nbytes = node.pages.size * rules.full.page_bytes
            nbytes += sum(n * w.cell_bytes for n, w in zip(node.window_resident, rules.windows, strict=True))
            nbytes += checkpoint_bytes if node.checkpoint >= 0 else 0
        else:
            assert isinstance(component, WindowRule)
            saved, nbytes = cost(node.start, node.end), node.window_resident[component.index] * component.cell_bytes
        return node.clock + max(1, node.hits) * saved / max(1, nbytes)


POLICIES = Registry[type[Policy]]("eviction policy", {p.name: p for p in (LRU, LFU, PriorityPolicy, CostAware)})


def make_policy(name: str) -> Policy:
    """A fresh policy by name; ``UnknownName`` (a ``ValueError``) names the known ones."""
    return POLICIES[name]()
