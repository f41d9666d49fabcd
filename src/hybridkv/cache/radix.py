"""The radix tree: namespaced roots, page-aligned walks, splits, leaves. Structure only.

Keys are token ids compared page by page; a walk never copies the tokens whole
(``bytes.startswith`` reads the slice's buffer). A namespace (an extra key, e.g. a tenant's
cache salt) has its own root: two namespaces never share a node. A root exists only while
its namespace holds a node: a match in an unknown namespace walks a detached empty root
(``empty_root``) and creates nothing; the root goes with its last node.

Invariants (``check_tree`` proves them):
- Every root in ``roots`` has a child (no empty root is kept).
- Every node below a root is reachable from exactly one root, under its parent's entry for
  the bytes of its first page; ``leaves`` is exactly the set of non-root nodes without
  children; ``num_nodes`` counts the non-root nodes.
- A split keeps every page id on every path: the upper half's path pages are a view of the
  lower half's. ``on_split(upper, lower)`` runs after each split, so the owners of per-node
  counts (residency, locks, event hashes, eviction keys) divide or copy theirs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterator

import numpy as np

from hybridkv.cache.errors import CacheError
from hybridkv.cache.node import Node

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False


class Walk:
    """How far ``tokens`` follow the tree below ``root``."""

    __slots__ = ("_seq", "full", "nodes", "page_size", "partial", "resident", "root")

    def __init__(self, root: Node, nodes: list[Node], partial: Node | None, full: int, page_size: int):
        self.root = root
        self.nodes = nodes
        """Nodes matched whole, in path order."""
        self.partial = partial
        """The node matched part-way (or None)."""
        self.full = full
        """Matched tokens, page-aligned: the longest full-KV match."""
        self.page_size = page_size
        self.resident: dict[int, np.ndarray] | None = None
        """Window residency masks of the walked pages, read lazily by window rules (by pool index)."""
        self._seq: list[Node] | None = None

    @property
    def seq(self) -> list[Node]:
        """``nodes`` and then ``partial`` (if any)."""
        if self._seq is None:
            self._seq = [*self.nodes, self.partial] if self.partial is not None else self.nodes
        return self._seq

    @property
    def pages(self) -> np.ndarray:
        """Page ids of the walked ``full`` tokens: a read-only view of the deepest node's path."""
        deepest = self.partial if self.partial is not None else self.nodes[-1] if self.nodes else self.root
        return deepest.path_pages[: self.full // self.page_size]


class RadixTree:
    def __init__(self, page_size: int, windows: int, on_split: Callable[[Node, Node], None]):
        self.page_size = page_size
        self.windows = windows
        self.roots: dict[Hashable, Node] = {}
        self.leaves: set[Node] = set()
        self.num_nodes = 0
        self._uids = itertools.count(1)
        self._first_page_bytes = page_size * 8
        self._on_split = on_split

    # --- roots ----------------------------------------------------------------------------

    def find_root(self, namespace: Hashable) -> Node | None:
        try:
            return self.roots.get(namespace)
        except TypeError:
            raise CacheError(f"extra_key must be hashable, got {type(namespace).__name__}") from None

    def empty_root(self, namespace: Hashable) -> Node:
        """A root for ``namespace`` that is not in the tree: what a match in a namespace
        holding nothing walks (an empty hit, lockable, creating nothing)."""
        return Node(0, b"", _EMPTY, _EMPTY, 0, None, namespace, self.windows)

    def add_root(self, namespace: Hashable) -> Node:
        root = self.empty_root(namespace)
        self.roots[namespace] = root
        return root

    def contains(self, node: Node) -> bool:
        """``node`` is alive in this tree (not evicted, not another tree's)."""
        if node.dead or node.namespace not in self.roots:
            return False
        root = node
        while root.parent is not None:
            root = root.parent
        return root is self.roots[node.namespace]

    def nodes(self) -> Iterator[tuple[Hashable, Node]]:
        """Every non-root node with its namespace (depth first)."""
        for namespace, root in self.roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield namespace, node
                stack.extend(node.children.values())

    # --- walks ----------------------------------------------------------------------------

    def walk(self, root: Node, toks: np.ndarray) -> Walk:
        """Fully matched nodes, the node matched part-way, matched tokens (page-aligned)."""
        ps, total = self.page_size, toks.size
        node, pos, nodes = root, 0, []
        while pos + ps <= total and node.children:
            child = node.children.get(toks[pos : pos + ps].tobytes())
            if child is None:
                break
            kb = child.kb
            n = len(kb) // 8
            if pos + n <= total and kb.startswith(toks[pos : pos + n]):  # type: ignore[arg-type]  # an ndarray is a buffer
                nodes.append(child)
                pos += n
                node = child
                continue
            key = child.key
            m = min(key.size, total - pos)
            diff = toks[pos : pos + m] != key[:m]
            i = int(np.argmax(diff)) if np.count_nonzero(diff) else m
            return Walk(root, nodes, child, pos + i - i % ps, ps)
        return Walk(root, nodes, None, pos, ps)

    def node_at(self, walk: Walk, end: int) -> Node:
        """The node ending at ``end`` on the walked path, splitting one if needed."""
        if end == 0:
            return walk.root
        nodes = walk.nodes
        if nodes and nodes[-1].end == end:
            return nodes[-1]
        for n in (*nodes, walk.partial):
            if n is None:
                break
            if n.end == end:
                return n
            if n.start < end < n.end:
                return self.split(n, end - n.start)
        raise AssertionError(f"position {end} is not on the walked path (walk bookkeeping bug)")

    # --- changes --------------------------------------------------------------------------

    def split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after ``k`` tokens; returns the new upper half (``node`` keeps the end)."""
        ps, pb = self.page_size, self._first_page_bytes
        kp = k // ps
        parent = node.parent
        assert parent is not None and 0 < k < node.end - node.start and k % ps == 0
        upper = Node(
            next(self._uids),
            node.kb[: k * 8],
            node.pages[:kp],
            node.path_pages[: (node.start + k) // ps],
            node.start,
            parent,
            node.namespace,
            self.windows,
        )
        parent.children[node.kb[:pb]] = upper
        node.kb, node.pages = node.kb[k * 8 :], node.pages[kp:]
        node.start += k
        node.parent = upper
        upper.children[node.kb[:pb]] = node
        self.num_nodes += 1
        self._on_split(upper, node)
        return upper

    def add_leaf(self, parent: Node, kb: bytes, path_pages: np.ndarray) -> Node:
        """A leaf under ``parent`` holding tokens ``kb`` on the pages ending ``path_pages``
        (read-only: the tree's own array, hits hand out views of it)."""
        node = Node(
            next(self._uids),
            kb,
            path_pages[parent.path_pages.size :],
            path_pages,
            parent.end,
            parent,
            parent.namespace,
            self.windows,
        )
        parent.children[kb[: self._first_page_bytes]] = node
        if parent.parent is not None:
            self.leaves.discard(parent)
        self.leaves.add(node)
        self.num_nodes += 1
        return node

    def remove_leaf(self, node: Node) -> Node | None:
        """Unlink a leaf; returns its parent when that became a leaf, else None. A root left
        without children leaves ``roots``."""
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.kb[: self._first_page_bytes]]
        self.leaves.discard(node)
        self.num_nodes -= 1
        node.dead = True
        if parent.children:
            return None
        if parent.parent is not None:
            self.leaves.add(parent)
            return parent
        if self.roots.get(parent.namespace) is parent:
            del self.roots[parent.namespace]
        return None
