"""Radix tree nodes: one node per run of whole pages shared by the same set of sequences.

Invariants (``check_tree`` proves them):
- ``kb`` holds the bytes of the node's tokens (int64, a whole number of pages); ``key`` reads
  them as a read-only int64 array (made on demand: hot paths compare bytes);
  ``pages[i]`` is the virtual page id of tokens ``key[i*ps:(i+1)*ps]``; a node is never empty.
- ``start`` is the position of the node's first token on its path, ``end = start + len(key)``
  (a plain field, kept by ``split``); ``parent.end == start``.
- ``path_pages`` is every page id from the root to ``end`` (read-only; an upper half made by a
  split holds a view of the lower half's array). Page ids on a path never change while the
  node lives, so a hit slices it instead of concatenating node arrays.
- A parent keys each child by the bytes of the child's first page.
- ``window_resident[i]`` counts this node's pages resident in window pool ``i`` (the rest
  are tombstones); ``checkpoint`` is the slot of the recurrent-state checkpoint taken after
  ``end`` tokens (or ``NO_CHECKPOINT``); ``checkpoints_below`` is the most checkpoints on
  any path strictly below the node; ``below_counts``, for a node with two children or more,
  how many children add each positive count to the paths through them (None with fewer:
  one child's count is the node's). Both are kept by ``Residency`` as checkpoints come and
  go, leaves come and go and nodes split; not for roots, which never hold a checkpoint.
- Lock counts (``lock`` for full KV, ``window_lock``, ``checkpoint_lock``) equal what the
  open ``CacheLock`` handles took (see ``locks.LockTable``).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

NO_CHECKPOINT = -1


class Node:
    __slots__ = (
        "below_counts",
        "checkpoint",
        "checkpoint_lock",
        "checkpoints_below",
        "children",
        "clock",
        "dead",
        "end",
        "hashes",
        "hits",
        "kb",
        "last_access",
        "lock",
        "namespace",
        "pages",
        "parent",
        "path_pages",
        "priority",
        "start",
        "uid",
        "window_lock",
        "window_resident",
    )

    def __init__(
        self,
        uid: int,
        kb: bytes,
        pages: np.ndarray,
        path_pages: np.ndarray,
        start: int,
        parent: Node | None,
        namespace: Hashable,
        windows: int,
    ):
        self.uid = uid
        self.kb = kb
        self.pages = pages
        self.path_pages = path_pages
        self.start = start
        self.end = start + len(kb) // 8
        self.parent = parent
        self.namespace = namespace
        self.children: dict[bytes, Node] = {}
        self.lock = 0
        self.window_lock = 0
        self.checkpoint = NO_CHECKPOINT
        self.checkpoint_lock = 0
        self.checkpoints_below = 0
        self.below_counts: dict[int, int] | None = None
        self.window_resident = [0] * windows
        self.last_access = 0
        self.hits = 0
        self.priority = 0
        self.clock = 0.0
        self.hashes: list[int] | None = None
        self.dead = False

    @property
    def key(self) -> np.ndarray:
        return np.frombuffer(self.kb, dtype=np.int64)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def path(self) -> list[Node]:
        """Nodes from the first below the root down to this one."""
        out = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        return (
            f"Node(uid={self.uid}, tokens=[{self.start}, {self.end}), pages={self.pages.size}, "
            f"lock={self.lock}, window_lock={self.window_lock}, checkpoint={self.checkpoint})"
        )
