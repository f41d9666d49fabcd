"""Where recurrent-state checkpoints go on insert, under a cap per root-to-leaf path.

A checkpoint given for position ``pos`` sits on the node ending at ``pos`` (split there if
needed). One already there wins: the new slot is not kept. A path holding more than
``max_per_path`` checkpoints drops the least valuable unlocked, unpinned ones above the new
one (non-branching nodes first, then least recently used); when those are not enough, the
new slot is not kept.

Invariant: no root-to-leaf path holds more than ``max_per_path`` checkpoints. Slots not
kept are returned to the caller, who owns them; dropped cached checkpoints are freed here
(they were the cache's).
"""

from __future__ import annotations

import numpy as np

from hybridkv.cache.node import Node
from hybridkv.cache.radix import RadixTree
from hybridkv.cache.residency import Residency
from hybridkv.memory import UnifiedMemory


class CheckpointCap:
    def __init__(self, mem: UnifiedMemory, tree: RadixTree, residency: Residency, max_per_path: int):
        self.mem = mem
        self.tree = tree
        self.residency = residency
        self.max_per_path = max_per_path

    def attach(self, last: Node, checkpoints: list[tuple[int, int]]) -> list[int]:
        """Attach ``(position, slot)`` pairs on the path ending at ``last``; returns the slots
        not kept."""
        unused: list[int] = []
        for pos, slot in checkpoints:
            node = last
            while node.start >= pos:
                assert node.parent is not None
                node = node.parent
            if node.end != pos:
                node = self.tree.split(node, pos - node.start)
            if node.checkpoint >= 0 or not self._make_room(node):
                unused.append(slot)
                continue
            self.residency.attach_checkpoint(node, slot)
            for below in _nearest_below(node):
                self.residency.refresh(below)  # their previous checkpoint moved closer: a key may drop
        return unused

    def _make_room(self, node: Node) -> bool:
        """Drop checkpoints above ``node`` so its paths stay within the cap; False if locked."""
        above = [a for a in node.path()[:-1] if a.checkpoint >= 0]
        excess = len(above) + 1 + _most_below(node) - self.max_per_path
        if excess <= 0:
            return True
        counters = self.residency.counters
        pins = self.mem.gates.slot_pins
        victims = [a for a in above if a.checkpoint_lock == 0 and not pins[a.checkpoint]]
        if len(victims) < excess:
            counters.capped_checkpoints += 1
            return False
        victims.sort(key=lambda a: (len(a.children) > 1, a.last_access))
        slots = [self.residency.drop_checkpoint(victim) for victim in victims[:excess]]
        self.mem.free_state(np.asarray(slots, dtype=np.int64))
        counters.capped_checkpoints += excess
        return True


def _nearest_below(node: Node) -> list[Node]:
    """The first checkpoint on every path below ``node``."""
    out, stack = [], list(node.children.values())
    while stack:
        n = stack.pop()
        if n.checkpoint >= 0:
            out.append(n)
        else:
            stack.extend(n.children.values())
    return out


def _most_below(node: Node) -> int:
    """Most checkpoints on any path strictly below ``node``."""
    best = 0
    stack = [(c, 0) for c in node.children.values()]
    while stack:
        n, above = stack.pop()
        count = above + (n.checkpoint >= 0)
        best = max(best, count)
        stack.extend((c, count) for c in n.children.values())
    return best
