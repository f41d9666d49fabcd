"""Eviction candidates of one component (its hit rule): a lazy min-heap ordered by the policy's key.

Members are a set the tree maintains (leaves for full KV, nodes with resident window
pages for a window pool, nodes with a checkpoint for state). Entries are never re-keyed in
place: an entry's key is a *lower bound* of its node's current key. Hits only raise keys
(recency, hit counts, the cost policy's clock), so a hit pushes nothing; the tree pushes a
node only when its key may drop (it joins a set, a split, it gains resident bytes or a
checkpoint). A pushed node waits in ``pending`` and gets its entry, with its key of that
moment, at the next ``pop``: inserts pay a list append, not a heap push.

Invariants (``check_tree`` proves the first):
- Every member is in ``pending`` or has an entry whose key is at most its current key.
- ``pop`` returns the member with the smallest current key (ties: the lowest uid): an entry
  of a non-member is dropped; an entry below its node's current key is pushed again with
  the current key.
- Stale entries and pending nodes never outnumber members by more than ``slack``: the heap
  is rebuilt from the members when they would, so memory and pops stay proportional to the
  members.
- ``parked`` holds popped members an eviction skipped because a lock holds them, with the lock
  table's count of unlocks at that moment (``parked_at``): they stay out of the heap, and out
  of every later eviction's way, until an unlock has happened since (``unpark``: they go back
  to ``pending``). A lock count only drops on an unlock, so while the count is unchanged every
  parked node is still locked: pops are the same as if it had stayed in the heap.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heapify, heappop, heappush

from hybridkv.cache.node import Node
from hybridkv.cache.rules import Rule


class Candidates:
    def __init__(self, component: Rule, key: Callable[[Node, Rule], object], members: set[Node], slack: int = 256):
        self.component = component
        self._key = key
        self.members = members
        self.heap: list[tuple[object, int, Node]] = []
        self.pending: list[Node] = []
        self.parked: list[Node] = []
        self.parked_at = 0
        self._slack = slack

    def key(self, node: Node) -> object:
        return self._key(node, self.component)

    def push(self, node: Node) -> None:
        """``node``'s key may have dropped: it gets an entry with its current key at the next pop."""
        self.pending.append(node)
        if len(self.heap) + len(self.pending) > 2 * len(self.members) + self._slack:
            self.rebuild()

    def park(self, node: Node, unlocks: int) -> None:
        """``node`` (popped) is locked: keep it out of the heap until an unlock; ``unlocks`` is
        the lock table's count of unlocks now."""
        self.unpark(unlocks)
        self.parked.append(node)
        self.parked_at = unlocks

    def unpark(self, unlocks: int) -> None:
        """The parked nodes go back (to ``pending``) if anything was unlocked since they were parked."""
        if self.parked and unlocks != self.parked_at:
            self.pending += self.parked
            self.parked = []
            if len(self.heap) + len(self.pending) > 2 * len(self.members) + self._slack:
                self.rebuild()

    def rebuild(self) -> None:
        component, key = self.component, self._key
        self.heap = [(key(n, component), n.uid, n) for n in self.members]
        heapify(self.heap)
        self.pending = []
        self.parked = []

    def pop(self) -> tuple[object, Node] | None:
        """The member with the smallest current key, taken out of the heap (not the set)."""
        heap, members, key, component = self.heap, self.members, self._key, self.component
        if self.pending:
            for node in self.pending:
                if node in members:
                    heappush(heap, (key(node, component), node.uid, node))
            self.pending = []
        while heap:
            k, uid, node = heappop(heap)
            if node not in members:
                continue
            current = key(node, component)
            if current == k:
                return k, node
            heappush(heap, (current, uid, node))
        return None
