"""The lock table: what a hit's lock protects, per component, and nothing more.

A lock on a hit ending at ``node.end`` counts on full KV of every node on the path, on the
window of the nodes covering the ``max_window`` tokens before the end (whole nodes), and on
the checkpoint at ``node`` (if it has one; a holder that forked the checkpoint may give that
part up alone with ``unlock_checkpoint``: a running request needs its own state slot, not
the cached copy).

Invariants (``check_tree`` proves them):
- Every node's counts equal what the open ``CacheLock`` handles took; nothing counted is
  evicted. A split copies the counts to both halves (``split``), and ``unlock`` walks the same
  token span as ``lock``, so counts stay exact.
- A handle is unlocked once: a second unlock, or one of another table's handle, is refused
  with nothing changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.cache.errors import LockError
from hybridkv.cache.node import Node


@dataclass(eq=False)
class CacheLock:
    """What one ``lock`` took; ``unlock`` gives back exactly that."""

    node: Node
    window_span: int
    """Tokens before ``node.end`` whose nodes hold a window lock (whole nodes)."""
    checkpoint_node: Node | None
    active: bool = True


class LockTable:
    def __init__(self, max_window: int, checkpoints: bool):
        self.max_window = max_window
        self.checkpoints = checkpoints
        self.open: set[CacheLock] = set()
        self.unlocks = 0
        """How many times a lock count dropped (``unlock``, ``unlock_checkpoint``): eviction
        candidates skipped as locked wait for it to change (``Candidates.park``)."""

    def lock(self, node: Node) -> CacheLock:
        """Lock a hit ending at ``node`` (the caller checked that ``node`` is in its tree)."""
        n: Node | None = node
        while n is not None and n.parent is not None:
            n.lock += 1
            n = n.parent
        span = 0
        n = node
        while self.max_window and n.parent is not None and span < self.max_window:
            n.window_lock += 1
            span += n.end - n.start
            n = n.parent
        checkpoint_node = None
        if self.checkpoints and node.checkpoint >= 0:
            node.checkpoint_lock += 1
            checkpoint_node = node
        handle = CacheLock(node, span, checkpoint_node)
        self.open.add(handle)
        return handle

    def unlock(self, handle: CacheLock) -> None:
        if not isinstance(handle, CacheLock):
            raise LockError(f"unlock: expected a CacheLock from lock(), got {type(handle).__name__}")
        if handle not in self.open:
            what = "was already unlocked (double unlock)" if not handle.active else "is not from this cache"
            raise LockError(f"unlock: this lock on {handle.node} {what}")
        n: Node | None = handle.node
        while n is not None and n.parent is not None:
            n.lock -= 1
            n = n.parent
        span = 0
        n = handle.node
        while span < handle.window_span:
            assert n.parent is not None, "window span reaches above the root (lock bookkeeping bug)"
            n.window_lock -= 1
            span += n.end - n.start
            n = n.parent
        if handle.checkpoint_node is not None:
            handle.checkpoint_node.checkpoint_lock -= 1
        handle.active = False
        self.open.discard(handle)
        self.unlocks += 1

    def unlock_checkpoint(self, handle: CacheLock) -> None:
        """Give back only the checkpoint part of an open lock (nothing when it holds none)."""
        if handle not in self.open:
            raise LockError(f"unlock_checkpoint: this lock on {handle.node} is not open in this cache")
        if handle.checkpoint_node is not None:
            handle.checkpoint_node.checkpoint_lock -= 1
            handle.checkpoint_node = None
            self.unlocks += 1

    @staticmethod
    def split(upper: Node, lower: Node) -> None:
        """The upper half of a split node is held by every lock that held the node."""
        upper.lock, upper.window_lock = lower.lock, lower.window_lock

    def expected_counts(self) -> dict[Node, tuple[int, int, int]]:
        """Per node, the (full, window, checkpoint) counts the open handles say (for checks)."""
        out: dict[Node, list[int]] = {}
        for handle in self.open:
            if not handle.active or handle.node.dead:
                raise AssertionError(f"cache check: open lock on {handle.node} is inactive or its node was evicted")
            for n in handle.node.path():
                out.setdefault(n, [0, 0, 0])[0] += 1
            span, n = 0, handle.node
            while span < handle.window_span:
                if n.parent is None:
                    raise AssertionError(f"cache check: lock on {handle.node} window span reaches above the root")
                out.setdefault(n, [0, 0, 0])[1] += 1
                span += n.key.size
                n = n.parent
            if span != handle.window_span:
                raise AssertionError(f"cache check: lock on {handle.node}: window span does not end on a node boundary")
            if handle.checkpoint_node is not None:
                if handle.checkpoint_node.checkpoint < 0:
                    raise AssertionError(f"cache check: lock on {handle.node}: its checkpoint was dropped while locked")
                out.setdefault(handle.checkpoint_node, [0, 0, 0])[2] += 1
        return {n: (c[0], c[1], c[2]) for n, c in out.items()}
