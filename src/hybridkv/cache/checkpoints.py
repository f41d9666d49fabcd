"""Where recurrent-state checkpoints go on insert, under a cap per root-to-leaf path.

``validate`` refuses (``InsertError``, nothing changed) positions that are not page-aligned
within the key, slots that are not live, and slots that are cached checkpoints already.

A checkpoint given for position ``pos`` sits on the node ending at ``pos`` (split there if
needed). One already there wins: the new slot is not kept. A path holding more than
``max_per_path`` checkpoints drops the least valuable unlocked, unpinned ones above the new
one (non-branching nodes first, then least recently used); when those are not enough, the
new slot is not kept. The most checkpoints on a path below a node is the node's own count
(``Node.checkpoints_below``, kept by ``Residency``): the cap never walks a subtree, and
one insert walks its path once, however many checkpoints it brings.

Invariant: no root-to-leaf path holds more than ``max_per_path`` checkpoints. Slots not
kept are returned to the caller, who owns them; dropped cached checkpoints are freed here
(they were the cache's).
"""

from __future__ import annotations

from collections.abc import Mapping
from heapq import heappop, heappush

import numpy as np

from hybridkv.cache.args import integer, mapping
from hybridkv.cache.errors import InsertError
from hybridkv.cache.node import Node
from hybridkv.cache.radix import RadixTree
from hybridkv.cache.residency import Residency
from hybridkv.memory import InvalidIds, UnifiedMemory


class CheckpointCap:
    def __init__(self, mem: UnifiedMemory, tree: RadixTree, residency: Residency, max_per_path: int):
        self.mem = mem
        self.tree = tree
        self.residency = residency
        self.max_per_path = max_per_path

    def validate(self, checkpoints: Mapping[int, int] | None, length: int) -> list[tuple[int, int]]:
        if checkpoints is None:
            return []
        given = mapping(checkpoints, "insert checkpoints")
        if not given:
            return []
        if self.residency.rules.checkpoint is None:
            raise InsertError(
                f"insert: checkpoints given but this shard ({self.mem.shard.describe()}) has no "
                "recurrent layers; pass checkpoints=None"
            )
        ckpts = sorted(
            (integer(p, "insert checkpoints: a position"), integer(s, f"insert checkpoints[{p!r}]: a state slot"))
            for p, s in given.items()
        )
        for pos, _slot in ckpts:
            if pos <= 0 or pos > length or pos % self.tree.page_size:
                raise InsertError(
                    f"insert: checkpoint position {pos} must be a multiple of the page size "
                    f"{self.tree.page_size} in 1..{length} (the key's length)"
                )
        slots = np.asarray([s for _, s in ckpts], dtype=np.int64)
        try:
            self.mem.slots.check_live(slots, "insert checkpoints")
        except InvalidIds as exc:
            raise InsertError(f"insert: {exc}; pass state slots this request allocated") from exc
        owned = self.residency.owned_slots[slots]
        if np.count_nonzero(owned):
            raise InsertError(
                f"insert: state slot {slots[np.argmax(owned)]} is already a cached checkpoint; "
                "fork it (fork_state) before handing a copy back"
            )
        return ckpts

    def attach(self, last: Node, checkpoints: list[tuple[int, int]]) -> list[int]:
        """Attach ``(position, slot)`` pairs (sorted by position) on the path ending at ``last``;
        returns the slots not kept.

        One walk down the path for the whole batch: positions go top-down, so each new
        checkpoint's count below (``checkpoints_below``) is untouched by the ones attached or
        dropped above it, and the ancestors' counts are brought up to date once at the end
        (``Residency.recount_path``). The checkpoints above the current position are counted
        as the walk passes them, the droppable ones kept in a heap ordered as the cap drops
        them, so a position costs O(log n) instead of a walk of its path."""
        residency = self.residency
        residency.settle()
        path = last.path()
        before = residency.path_contributions(path)
        pins = self.mem.gates.slot_pins
        victims: list[tuple[bool, int, int, Node]] = []  # (branching, last access, start): first dropped
        above = 0  # checkpoints on the path above the current position
        kept: list[Node] = []
        unused: list[int] = []

        def passed(n: Node) -> None:
            nonlocal above
            if n.checkpoint >= 0:
                above += 1
                if n.checkpoint_lock == 0 and not pins[n.checkpoint]:
                    heappush(victims, (len(n.children) > 1, n.last_access, n.start, n))

        i = 0
        for pos, slot in checkpoints:
            while path[i].end < pos:
                passed(path[i])
                i += 1
            node = path[i]
            if node.end != pos:
                node = self.tree.split(node, pos - node.start)  # path[i] is the lower half now
            else:
                i += 1
            if node.checkpoint >= 0:
                unused.append(slot)
            else:
                excess = above + 1 + node.checkpoints_below - self.max_per_path
                if excess > 0 and not self._drop_above(victims, excess):
                    unused.append(slot)
                else:
                    above -= max(excess, 0)
                    residency.attach_checkpoint(node, slot, count=False)
                    kept.append(node)
            passed(node)
        residency.recount_path(last, before)
        for node in kept:
            if node.checkpoint >= 0:  # not dropped again by a later one
                for below in _nearest_below(node):
                    residency.refresh(below)  # their previous checkpoint moved closer: a key may drop
        return unused

    def _drop_above(self, victims: list[tuple[bool, int, int, Node]], excess: int) -> bool:
        """Drop the ``excess`` least valuable unlocked, unpinned checkpoints above (non-branching
        nodes first, then least recently used, then nearest the root); False, nothing dropped,
        if there are fewer."""
        counters = self.residency.counters
        if len(victims) < excess:
            counters.capped_checkpoints += 1
            return False
        slots = [self.residency.drop_checkpoint(heappop(victims)[3], count=False) for _ in range(excess)]
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
