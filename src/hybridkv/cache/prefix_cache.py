"""HybridRadixCache: prefix hits valid for every component of a hybrid model, over a radix tree.

A hit of length ``E`` is returned only if full KV covers ``[0, E)``, every pool that releases
history holds the pages of the span its pool id's rule needs before ``E`` (``[E - W, E)``
for a window ``W``) and, when the model has recurrent layers, a state
checkpoint sits exactly at ``E`` (``rules.py``). Keys are namespaced by an optional extra key
(a tenant's cache salt): two namespaces never share a node.

The parts: ``RadixTree`` (structure), ``HitRules`` (validity per component), ``LockTable``,
``Residency`` (what is cached per component, candidates, events), ``Evictor``,
``CheckpointCap`` (placement under the path cap), ``Dedupe`` (duplicates, window recovery).
This class composes them into ``match_prefix`` / ``insert`` / ``lock`` / ``evict``. It
never allocates: ``KVManager`` (``manager.py``) allocates with eviction above it.

Invariants (``check_tree`` proves them; tests call it after every step):
- Every cached page id appears in exactly one node, is live and resident in every
  full-history pool; lock counts equal what the open locks took; no path holds more than
  ``max_checkpoints_per_path`` checkpoints.
- Ownership: ``insert`` keeps the pages and checkpoint slots it caches and hands back the
  rest in its result (duplicates of cached pages, slots not kept): the caller frees those.
  What it keeps carries the memory's owner mark: every free of it but the cache's own
  (eviction) is refused by the memory, so a cached id is never reallocated under a hit.
  A refused call (``CacheError``) changes neither the tree nor the pools.
- A namespace's root exists only while the namespace holds a node: matching an unknown
  namespace creates nothing.
- Everything here runs on host ids (numpy / Python ints); nothing reads device memory.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from hybridkv.cache.args import as_array, integer
from hybridkv.cache.checkpoints import CheckpointCap
from hybridkv.cache.dedupe import Dedupe
from hybridkv.cache.errors import CacheError, InsertError, LockError
from hybridkv.cache.events import EventLog, root_hash
from hybridkv.cache.evictor import Evictor
from hybridkv.cache.locks import CacheLock, LockTable
from hybridkv.cache.node import Node
from hybridkv.cache.policies import Policy, RecomputeCost, make_policy
from hybridkv.cache.radix import RadixTree, Walk
from hybridkv.cache.residency import Residency, ResidencyHook
from hybridkv.cache.rules import HitRules, Need
from hybridkv.memory import UnifiedMemory

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False
_INT64 = np.dtype(np.int64)


@dataclass(slots=True)
class MatchResult:
    """A hit (read-only by convention: it is built on every match, so it is not frozen)."""

    node: Node
    """The node that ends at ``length`` (the namespace root when ``length == 0``, detached from
    the tree when the namespace holds nothing): lock it."""
    length: int
    """Tokens valid for every component."""
    pages: np.ndarray
    """Page ids of tokens ``[0, length)`` (a read-only view of the cache's own array)."""
    checkpoint: int | None
    """The checkpoint slot at ``length`` (fork it before writing), or None."""
    full_length: int
    """Page-aligned full-KV match, ignoring windows and checkpoints."""
    window_length: int
    """Longest hit valid for full KV and every window, ignoring checkpoints."""
    checkpoint_length: int
    """Deepest checkpoint on the full-KV match, ignoring windows."""
    checkpoint_at: int | None
    """Where a request computing from ``length`` should checkpoint its state and keep its
    window (the cached full KV ends there, so the next hit there becomes valid); None when
    ``full_length == length``."""
    window_lengths: tuple[int, ...] = ()
    """Longest hit valid for full KV and each window pool alone (``rules.windows`` order)."""


@dataclass(slots=True)
class InsertResult:
    node: Node
    """The node ending at the inserted key's end."""
    prefix_len: int
    """Tokens of the key that were cached already."""
    pages: np.ndarray
    """The cache's page ids for the whole key (read-only): the request uses these from now on."""
    duplicates: np.ndarray
    """The caller's pages that duplicate cached ones: not kept, the caller frees them."""
    adopted_pages: int
    """Window pages rebound from the caller's duplicates onto tombstoned cached pages."""
    unused_checkpoints: list[int]
    """Checkpoint slots not kept (one was cached there already, or the path cap): the
    caller frees them."""


def _tokens(tokens: object, what: str) -> np.ndarray:
    if type(tokens) is np.ndarray and tokens.dtype is _INT64 and tokens.ndim == 1 and tokens.flags.c_contiguous:
        return tokens  # the common case, without a copy
    arr = as_array(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise CacheError(f"{what}: tokens must be a 1-D integer array, got shape {arr.shape} {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _page_ids(pages: object, what: str) -> np.ndarray:
    if type(pages) is np.ndarray and pages.dtype is _INT64 and pages.ndim == 1:
        return pages
    arr = as_array(pages)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InsertError(f"{what}: need a 1-D integer array of page ids, got shape {arr.shape} {arr.dtype}")
    return arr.astype(np.int64, copy=False)


class HybridRadixCache:
    def __init__(
        self,
        mem: UnifiedMemory,
        *,
        policy: str | Policy = "lru",
        max_checkpoints_per_path: int = 8,
        events: bool = False,
    ):
        integer(max_checkpoints_per_path, "max_checkpoints_per_path", minimum=1)
        if not isinstance(policy, str | Policy):
            raise CacheError(f"policy must be a policy name or a Policy, got {type(policy).__name__} {policy!r}")
        if not isinstance(mem, UnifiedMemory):
            raise CacheError(f"HybridRadixCache: expected a UnifiedMemory, got {type(mem).__name__}")
        window_held = any(mem.windows.held_count(p.pool_id) for p in mem.window_pools)
        if mem.pages.holder is not None and (mem.pages.held.any() or mem.slots.held.any() or window_held):
            raise CacheError(
                "HybridRadixCache: another prefix cache already holds this memory's pages; one cache "
                "per memory (build a new memory for a second cache, or evict the first one empty)"
            )
        self.mem = mem
        self.page_size = mem.page_size
        self.rules = HitRules(mem)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy.bind(self.rules, RecomputeCost(mem.shard))
        overridden = type(self.policy).touched is not Policy.touched
        self._touched = self.policy.touched if overridden else None
        self.max_checkpoints_per_path = max_checkpoints_per_path
        self.events = EventLog(events)
        self.tree = RadixTree(mem.page_size, len(self.rules.windows), self._after_split)
        self.residency = Residency(mem, self.tree, self.rules, self.policy, self.events)
        self.locks = LockTable(self.rules.max_window, self.rules.checkpoint is not None)
        self.evictor = Evictor(mem, self.rules, self.residency, self.policy, self.locks)
        self.checkpoints = CheckpointCap(mem, self.tree, self.residency, max_checkpoints_per_path)
        self.dedupe = Dedupe(mem, self.rules, self.residency)
        self.counters = self.residency.counters
        self._full_only = self.rules.full_only
        self._tick = 0

    # --- queries --------------------------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        return self.residency.cached_pages

    @property
    def cached_tokens(self) -> int:
        return self.residency.cached_pages * self.page_size

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def num_checkpoints(self) -> int:
        return len(self.residency.checkpoint_nodes)

    @property
    def open_locks(self) -> int:
        return len(self.locks.open)

    def match_prefix(self, tokens: object, extra_key: Hashable = None) -> MatchResult:
        """Longest prefix of ``tokens`` valid for every component (page-aligned).

        May split the node where the hit ends, so that a lock covers exactly the hit. A
        namespace holding nothing gives an empty hit on a detached root: nothing is created.
        """
        toks = _tokens(tokens, "match_prefix")
        try:
            root = self.tree.roots[extra_key]
        except (KeyError, TypeError):
            known = self.tree.find_root(extra_key)  # a CacheError for an unhashable key
            if known is None:
                return self._empty_match(extra_key)
            root = known
        walk = self.tree.walk(root, toks)
        full = walk.full
        if self._full_only:
            end = window_len = checkpoint_len = full
            window_lens: tuple[int, ...] = ()
        else:
            end, window_len, checkpoint_len = self.rules.valid_end(walk)
            window_lens = self.rules.window_ends(walk, window_len)
        nodes = walk.nodes
        if nodes and nodes[-1].end == end:
            node = nodes[-1]
            self._touch(nodes, None)
        else:
            node = self.tree.node_at(walk, end)
            self._touch(node.path(), None)
        self.counters.matches += 1
        return MatchResult(
            node,
            end,
            node.path_pages,  # the node ends at the hit's end
            node.checkpoint if end and node.checkpoint >= 0 else None,
            full,
            window_len,
            checkpoint_len,
            full if full > end else None,
            window_lens,
        )

    def _empty_match(self, namespace: Hashable) -> MatchResult:
        if self.events.enabled:
            root_hash(namespace)  # refuses a key events cannot name, as an insert there would
        self.counters.matches += 1
        root = self.tree.empty_root(namespace)
        return MatchResult(root, 0, root.path_pages, None, 0, 0, 0, None, (0,) * len(self.rules.windows))

    # --- insert ---------------------------------------------------------------------------

    def insert(
        self,
        tokens: object,
        pages: object,
        *,
        extra_key: Hashable = None,
        checkpoints: Mapping[int, int] | None = None,
        priority: int = 0,
    ) -> InsertResult:
        """Cache ``tokens`` (a whole number of pages) held in ``pages``, one id per page.

        ``checkpoints`` maps page-aligned positions (``0 < pos <= len(tokens)``) to slots
        holding the recurrent state after ``pos`` tokens. The cache keeps the pages and
        slots it caches; the result names those it does not keep (duplicates of cached
        pages, whose window pages first rebind onto cached pages that lost theirs, and
        slots not kept): the caller frees them.
        """
        ps = self.page_size
        toks = _tokens(tokens, "insert")
        req = _page_ids(pages, "insert pages")
        priority = integer(priority, "insert priority")
        if toks.size != req.size * ps:
            raise InsertError(
                f"insert: {toks.size} tokens but {req.size} pages of {ps} tokens ({req.size * ps} "
                "tokens); pass len(pages) * page_size tokens (cut the unaligned tail and free its page)"
            )
        ckpts = self.checkpoints.validate(checkpoints, toks.size) if checkpoints is not None else []
        root = self.tree.find_root(extra_key)
        walk = self.tree.walk(root, toks) if root is not None else None
        full = walk.full if walk is not None else 0
        fp = full // ps
        cached = walk.pages if walk is not None else _EMPTY
        req_bytes = req.tobytes()
        dup_idx = self.dedupe.duplicates(req, req_bytes, cached)
        dup_pages = req[dup_idx] if dup_idx.size else _EMPTY
        gates = self.mem.gates
        if dup_pages.size and np.count_nonzero(gates.page_pins[dup_pages]):
            raise InsertError(
                "insert: a duplicate page the caller must free is pinned by a move gate; release "
                "the gate (the forward or transfer using it) before inserting"
            )
        slots = [slot for _, slot in ckpts]
        if slots and np.count_nonzero(gates.slot_pins[slots]):
            raise InsertError(
                "insert: a checkpoint slot is pinned by a move gate; release it (the copy writing the "
                "checkpoint) before handing it to the cache"
            )

        # --- validated: from here on nothing refuses ---
        if walk is None:  # a new namespace: its root is made with its first node
            walk = Walk(self._root(extra_key) if toks.size else self.tree.empty_root(extra_key), [], None, 0, ps)
        adopted = self.dedupe.adopt_windows(walk, dup_idx, dup_pages) if dup_pages.size else 0
        nodes = walk.nodes
        if nodes and nodes[-1].end == full:
            last, path = nodes[-1], nodes
        else:
            last = self.tree.node_at(walk, full)
            path = last.path()
        if full < toks.size:
            if dup_idx.size:
                path_pages = np.concatenate([cached, req[fp:]])
                path_pages.setflags(write=False)
            else:  # the request's pages are the path: a read-only copy of them
                path_pages = np.frombuffer(req_bytes, dtype=np.int64)
            last = self.tree.add_leaf(last, toks[full:].tobytes(), path_pages)
            self.residency.add_leaf(last)
            path = [*path, last]
        unused = self.checkpoints.attach(last, ckpts) if ckpts else []
        self._touch(last.path() if ckpts else path, priority)
        self.counters.inserts += 1
        self.counters.duplicate_pages += int(dup_pages.size)
        self.counters.adopted_pages += adopted
        return InsertResult(last, full, last.path_pages, dup_pages, adopted, unused)

    # --- locks and eviction ---------------------------------------------------------------

    def lock(self, node: Node) -> CacheLock:
        """Protect a hit ending at ``node.end``: full KV on the path, the window before it
        (the node where the window starts is split there first), the checkpoint at ``node``
        (if any; ``unlock_checkpoint`` lets go of it alone). Give it back with ``unlock``. A
        root (an empty hit) protects nothing: its lock is valid whether or not the root is in
        the tree."""
        if not isinstance(node, Node):
            raise LockError(f"lock: expected a Node from match_prefix or insert, got {type(node).__name__}")
        if not node.is_root and not self.tree.contains(node):
            raise LockError(f"lock: {node} is not in this cache (evicted, or another cache's node)")
        if self.rules.max_window and not node.is_root:
            self._split_at_window_start(node)
        return self.locks.lock(node)

    def _split_at_window_start(self, node: Node) -> None:
        """Cut the node holding the first page of the window before ``node.end`` there, so that
        a lock's window covers the window's pages only: a long node before it (a request's
        whole prompt) keeps no window lock on pages behind the window, which eviction may
        tombstone while the request runs."""
        start = (node.end - self.rules.max_window) // self.page_size * self.page_size
        if start <= 0:
            return
        n = node
        while n.parent is not None and n.start > start:
            n = n.parent
        if n.parent is not None and n.start < start < n.end:
            self.tree.split(n, start - n.start)

    def unlock(self, handle: CacheLock) -> None:
        self.locks.unlock(handle)

    def unlock_checkpoint(self, handle: CacheLock) -> None:
        """Give back only the checkpoint part of ``handle`` (a running request that forked it
        and is short of memory): full KV and window stay locked; the checkpoint may be evicted."""
        if not isinstance(handle, CacheLock):
            raise LockError(f"unlock_checkpoint: expected a CacheLock from lock(), got {type(handle).__name__}")
        self.locks.unlock_checkpoint(handle)

    def take_checkpoint(self, lock: CacheLock) -> int | None:
        """Hand the checkpoint ``lock`` holds to its holder as its own slot (a request with no
        room to fork it: it runs on the checkpoint itself), out of the cache (counted as
        evicted); None, nothing changed, when another lock or a move gate holds it too."""
        node = lock.checkpoint_node
        if node is None or not lock.active or node.checkpoint_lock != 1 or self.mem.gates.slot_pins[node.checkpoint]:
            return None
        self.locks.unlock_checkpoint(lock)
        self.counters.evicted_checkpoints += 1
        return self.residency.drop_checkpoint(node)

    def set_residency_hook(self, hook: ResidencyHook | None) -> None:
        """Tell ``hook`` (storage tiers below the device) what the tree stores and evicts
        (``residency.ResidencyHook``); None detaches it. Attaching only on an empty tree:
        every node must carry its page names from its insert on."""
        if hook is not None and self.tree.num_nodes:
            raise CacheError(
                f"set_residency_hook: the tree holds {self.tree.num_nodes} nodes already; set the hook "
                "before the first insert (nodes inserted before it carry no page names)"
            )
        self.residency.hook = hook

    def evict(self, needs: Mapping[Need, int], *, for_slabs: bool = False) -> dict[Need, int]:
        """See ``Evictor.evict``: cells freed per pool (and whole pages under ``PAGE_NEED``)."""
        if not isinstance(for_slabs, bool):
            raise CacheError(f"evict for_slabs must be a bool, got {type(for_slabs).__name__}")
        return self.evictor.evict(needs, for_slabs=for_slabs)

    # --- structure ------------------------------------------------------------------------

    def _root(self, namespace: Hashable) -> Node:
        root = self.tree.find_root(namespace)
        if root is None:
            hashes = [root_hash(namespace)] if self.residency.names_pages else None  # refuses an unnameable key first
            root = self.tree.add_root(namespace)
            root.hashes = hashes
        return root

    def _after_split(self, upper: Node, lower: Node) -> None:
        upper.last_access, upper.hits = lower.last_access, lower.hits
        upper.priority, upper.clock = lower.priority, lower.clock
        LockTable.split(upper, lower)
        self.residency.split(upper, lower)

    def _touch(self, path: list[Node], priority: int | None) -> None:
        self._tick += 1
        tick, touched = self._tick, self._touched
        for n in path:
            n.last_access = tick
            n.hits += 1
            if priority is not None and priority > n.priority:
                n.priority = priority
            if touched is not None:
                touched(n)

    # --- reports --------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        c, res = self.counters, self.residency
        return {
            "policy": self.policy.name,
            "nodes": self.num_nodes,
            "cached_tokens": self.cached_tokens,
            "window_resident_pages": {
                w.label: sum(n.window_resident[w.index] for n in res.window_nodes[w.index]) for w in self.rules.windows
            },
            "states": self.num_checkpoints,
            "open_locks": self.open_locks,
            "matches": c.matches,
            "inserts": c.inserts,
            "duplicate_pages": c.duplicate_pages,
            "adopted_pages": c.adopted_pages,
            "evicted_pages": c.evicted_pages,
            "tombstoned_pages": {str(pool): n for pool, n in c.tombstoned.items()},
            "window_cached_pages": {w.label: res.window_cache.count(w) for w in self.rules.windows},
            "reclaimed_window_cached_pages": {str(pool): n for pool, n in c.reclaimed.items()},
            "evicted_states": c.evicted_checkpoints,
            "capped_states": c.capped_checkpoints,
            "given_up_states": c.given_up_checkpoints,
        }

    def check(self) -> None:
        """Prove the tree's invariants against the memory's host tables (tests, debugging)."""
        from hybridkv.cache.check import check_tree

        check_tree(self)
