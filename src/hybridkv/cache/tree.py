"""HybridRadixCache: a radix tree over page-aligned token keys whose hits are valid for
every component of a hybrid model (full KV, sliding-window KV, recurrent state).

A hit of length ``E`` is returned only if full KV covers ``[0, E)``, every window pool holds
the pages of ``[E - window, E)`` and, when the model has recurrent layers, a state
checkpoint sits exactly at ``E``. Keys are namespaced by an optional extra key (a tenant's
cache salt): two namespaces never share a node.

Invariants (``check_tree`` proves them; tests call it after every step):
- Every cached page id appears in exactly one node, is live in the memory and resident in
  every full-history pool; ``_owned`` marks exactly these ids (``_owned_slots`` the state
  checkpoints). A node's SWA residency is read from the memory's host tables, counted in
  ``swa_res``; a tombstoned page stays in the tree (its full KV is still valid).
- Lock counts equal what the open ``CacheLock`` handles took: full KV on the whole path,
  SWA on the nodes covering the window before the lock's end, state on the end node only.
  Nothing locked is evicted; a split copies counts to both halves, and unlock walks the
  same token span, so counts stay exact.
- No root-to-leaf path holds more than ``max_states_per_path`` checkpoints.
- Ownership: ``insert`` takes the pages and slots it is given; those it does not keep
  (duplicates of cached ones) it frees before returning. A refused call (``CacheError``)
  changes neither the tree nor the pools.
- Everything here runs on host ids (numpy / Python ints); nothing reads device memory.

Eviction (``eviction.py``) and the candidate heaps it pops (``candidates.py``) are mixed in.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import numpy as np

from hybridkv.cache.candidates import Candidates
from hybridkv.cache.components import Components
from hybridkv.cache.errors import CacheError, InsertError, LockError
from hybridkv.cache.events import CacheEvent, EventKind, EventLog, chain_hashes, root_hash
from hybridkv.cache.eviction import PAGE_NEED, Eviction, Need, Release
from hybridkv.cache.node import NO_STATE, Node
from hybridkv.cache.policies import Policy, RecomputeCost, make_policy
from hybridkv.memory import InvalidIds, UnifiedMemory
from hybridkv.spec import RECURRENT_POOL, PoolId

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False
_INT64 = np.dtype(np.int64)


@dataclass(slots=True)
class MatchResult:
    """A hit (read-only by convention: it is built on every match, so it is not frozen)."""

    node: Node
    """The node that ends at ``length`` (the namespace root when ``length == 0``): lock it."""
    length: int
    """Tokens valid for every component."""
    pages: np.ndarray
    """Page ids of tokens ``[0, length)`` (a read-only view of the cache's own array)."""
    state: int | None
    """The checkpoint slot at ``length`` (fork it before writing), or None."""
    full_length: int
    """Page-aligned full-KV match, ignoring windows and state."""
    swa_length: int
    """Longest hit valid for full KV and every window, ignoring state."""
    state_length: int
    """Deepest checkpoint on the full-KV match, ignoring windows."""
    checkpoint_at: int | None
    """Where a request computing from ``length`` should checkpoint its state and keep its
    window (the cached full KV ends there, so the next hit there becomes valid); None when
    ``full_length == length``."""


@dataclass(slots=True)
class InsertResult:
    node: Node
    """The node ending at the inserted key's end."""
    prefix_len: int
    """Tokens of the key that were cached already."""
    pages: np.ndarray
    """The cache's page ids for the whole key (read-only): the request uses these from now on."""
    freed_pages: int
    """Duplicate pages the request computed, now freed."""
    adopted_pages: int
    """Window pages rebound from the request's duplicates onto tombstoned cached pages."""
    freed_states: int
    """Checkpoint slots not kept (one was cached there already, or the path cap)."""


@dataclass(eq=False)
class CacheLock:
    """What one ``lock`` took; ``unlock`` gives back exactly that."""

    node: Node
    swa_span: int
    """Tokens before ``node.end`` whose nodes hold an SWA lock (whole nodes)."""
    state_node: Node | None
    active: bool = True


@dataclass
class CacheCounters:
    matches: int = 0
    inserts: int = 0
    duplicate_pages: int = 0
    adopted_pages: int = 0
    evicted_pages: int = 0
    """Full KV pages freed by eviction (whole leaves)."""
    tombstoned: dict[PoolId, int] = field(default_factory=dict)
    """Window pages freed by SWA eviction, per window pool (full KV kept)."""
    evicted_states: int = 0
    capped_states: int = 0


def _tokens(tokens: object, what: str) -> np.ndarray:
    if type(tokens) is np.ndarray and tokens.dtype is _INT64 and tokens.ndim == 1 and tokens.flags.c_contiguous:
        return tokens  # the common case, without a copy
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise CacheError(f"{what}: tokens must be a 1-D integer array, got shape {arr.shape} {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


class HybridRadixCache(Eviction):
    def __init__(
        self,
        mem: UnifiedMemory,
        *,
        policy: str | Policy = "lru",
        max_states_per_path: int = 8,
        events: bool = False,
    ):
        if max_states_per_path < 1:
            raise CacheError(f"max_states_per_path must be >= 1, got {max_states_per_path}")
        self.mem = mem
        self.comps = Components(mem)
        self.page_size = mem.page_size
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy.bind(self.comps, RecomputeCost(mem.shard))
        overridden = type(self.policy).touched is not Policy.touched
        self._touched = self.policy.touched if overridden else None
        self.max_states_per_path = max_states_per_path
        self._full_only = self.comps.full_only
        self.events = EventLog(events)
        self.counters = CacheCounters(tombstoned={w.pool_id: 0 for w in self.comps.windows})
        self._roots: dict[Hashable, Node] = {}
        self._uids = itertools.count(1)
        self._tick = 0
        self._leaves: set[Node] = set()
        self._swa_nodes: list[set[Node]] = [set() for _ in self.comps.windows]
        self._state_nodes: set[Node] = set()
        self._window_pools = [mem.pools[w.pool_id] for w in self.comps.windows]
        self._owned = np.zeros(mem.pages.capacity, dtype=bool)
        self._owned_slots = np.zeros(mem.slots.capacity, dtype=bool)
        self._locks: set[CacheLock] = set()
        key = self.policy.key
        self._full = Candidates(self.comps.history[0] if self.comps.history else PAGE_NEED, key, self._leaves)
        windows = zip(self.comps.windows, self._swa_nodes, strict=True)
        self._swa_heaps = [Candidates(w.pool_id, key, s) for w, s in windows]
        self._state_heap = Candidates(self.comps.state or RECURRENT_POOL, key, self._state_nodes)
        self.cached_pages = 0
        self.num_nodes = 0
        self._first_page_bytes = self.page_size * 8

    # --- queries --------------------------------------------------------------------------

    @property
    def cached_tokens(self) -> int:
        return self.cached_pages * self.page_size

    @property
    def num_states(self) -> int:
        return len(self._state_nodes)

    def match_prefix(self, tokens: object, extra_key: Hashable = None) -> MatchResult:
        """Longest prefix of ``tokens`` valid for every component (page-aligned).

        May split the node where the hit ends, so that a lock covers exactly the hit.
        """
        toks = _tokens(tokens, "match_prefix")
        try:
            root = self._roots[extra_key]
        except (KeyError, TypeError):
            root = self._root(extra_key)  # a new namespace (or a CacheError for an unhashable key)
        nodes, partial, full = self._walk(root, toks)
        if self._full_only:
            end = swa_len = state_len = full
        else:
            end, swa_len, state_len = self._valid_end(root, nodes, partial, full)
        if nodes and nodes[-1].end == end:
            node = nodes[-1]
            self._touch(nodes, None)
        else:
            node = self._node_at(root, nodes, partial, end)
            self._touch(node.path(), None)
        self.counters.matches += 1
        return MatchResult(
            node,
            end,
            node.path_pages,  # the node ends at the hit's end
            node.state if end and node.state >= 0 else None,
            full,
            swa_len,
            state_len,
            full if full > end else None,
        )

    def _valid_end(self, root: Node, nodes: list[Node], partial: Node | None, full: int) -> tuple[int, int, int]:
        """The hit's end valid for every component, the longest valid for full KV and the
        windows, and the deepest checkpoint on the full-KV match (``full`` tokens walked)."""
        comps, ps = self.comps, self.page_size
        walked = self._walked_pages(root, nodes, partial, full)
        seq = [*nodes, partial] if partial is not None else nodes
        resident: list[np.ndarray] = []  # page-level residency, read only when nodes cannot tell

        def holds(e: int) -> bool:
            known = self._windows_hold(seq, e)
            if known is not None:
                return known
            if not resident:
                resident.extend(pool.resident(walked) for pool in self._window_pools)
            return comps.window_ok(resident, e // ps)

        swa_len = full
        if comps.windows and not holds(full):
            if not resident:
                resident.extend(pool.resident(walked) for pool in self._window_pools)
            swa_len = comps.longest_window_end(resident, full // ps) * ps
        if comps.state is None:
            return swa_len, swa_len, swa_len
        ends = [n.end for n in nodes if n.state >= 0]
        state_len = ends[-1] if ends else 0
        return next((e for e in reversed(ends) if holds(e)), 0), swa_len, state_len

    # --- insert ---------------------------------------------------------------------------

    def insert(
        self,
        tokens: object,
        pages: object,
        *,
        extra_key: Hashable = None,
        states: Mapping[int, int] | None = None,
        priority: int = 0,
    ) -> InsertResult:
        """Cache ``tokens`` (a whole number of pages) held in ``pages``, one id per page.

        ``states`` maps page-aligned positions (``0 < pos <= len(tokens)``) to checkpoint
        slots holding the recurrent state after ``pos`` tokens. The cache takes ownership of
        every page and slot given: duplicates of cached ones are freed here (a duplicate's
        window pages first rebind onto cached pages whose window was evicted).
        """
        ps = self.page_size
        toks = _tokens(tokens, "insert")
        req = self._page_ids(pages, "insert pages")
        if toks.size != req.size * ps:
            raise InsertError(
                f"insert: {toks.size} tokens but {req.size} pages of {ps} tokens ({req.size * ps} "
                "tokens); pass len(pages) * page_size tokens (cut the unaligned tail and free its page)"
            )
        ckpts = self._check_states(states, toks.size)
        root = self._find_root(extra_key)
        nodes, partial, full = self._walk(root, toks) if root is not None else ([], None, 0)
        fp = full // ps
        cached = self._walked_pages(root, nodes, partial, full) if root is not None else _EMPTY
        req_bytes = req.tobytes()
        dup_idx = self._check_pages(req, req_bytes, cached)
        dup_pages = req[dup_idx] if dup_idx.size else _EMPTY
        if dup_pages.size and np.count_nonzero(self.mem.gates.page_pins[dup_pages]):
            raise InsertError(
                "insert: a duplicate page the cache would free is pinned by a move gate; release "
                "the gate (the forward or transfer using it) before inserting"
            )
        slots = [slot for _, slot in ckpts]
        if slots and np.count_nonzero(self.mem.gates.slot_pins[slots]):
            raise InsertError(
                "insert: a state slot is pinned by a move gate; release it (the copy writing the "
                "checkpoint) before handing it to the cache"
            )

        # --- validated: from here on nothing refuses ---
        if root is None:
            root = self._root(extra_key)
        n_dup = int(dup_pages.size)
        adopted = 0
        if n_dup:
            adopted = self._adopt_windows(nodes, partial, cached, dup_idx, dup_pages)
            self.mem.free_pages(dup_pages)
        if nodes and nodes[-1].end == full:
            last, path = nodes[-1], nodes
        else:
            last = self._node_at(root, nodes, partial, full)
            path = last.path()
        if full < toks.size:
            if dup_idx.size:
                path_pages = np.concatenate([cached, req[fp:]])
                path_pages.setflags(write=False)
            else:  # the request's pages are the path: a read-only copy of them
                path_pages = np.frombuffer(req_bytes, dtype=np.int64)
            last = self._add_child(last, toks[full:].tobytes(), path_pages)
            path = [*path, last]
        freed_states = self._attach_states(last, ckpts) if ckpts else 0
        self._touch(last.path() if ckpts else path, priority)
        self.counters.inserts += 1
        self.counters.duplicate_pages += n_dup
        self.counters.adopted_pages += adopted
        return InsertResult(last, full, last.path_pages, n_dup, adopted, freed_states)

    def _check_pages(self, req: np.ndarray, req_bytes: bytes, cached: np.ndarray) -> np.ndarray:
        """Refuse ``req`` (``req_bytes``: its bytes) unless every page that is not the cache's
        own page at its position (a duplicate of a cached page, or a page past the cached
        prefix) is in range, live, given once and not cached elsewhere. Returns the positions
        of the duplicates.

        The cache's own pages at their own positions need no check: they are live and
        distinct (tree invariants), and a repeat of one elsewhere in ``req`` is cached elsewhere.
        """
        fp = cached.size
        dup_idx = _EMPTY
        if fp and not req_bytes.startswith(cached):  # usually the request passes the cache's own pages
            dup_idx = np.flatnonzero(req[:fp] != cached)
        where = np.concatenate([dup_idx, np.arange(fp, req.size)]) if dup_idx.size else None
        given = req[where] if where is not None else req[fp:]
        if not given.size:
            return dup_idx
        ordered = np.sort(given)  # the table reads below go in order
        try:
            self.mem.pages.check_live(ordered, "insert", ordered)
        except InvalidIds as exc:
            raise InsertError(f"{exc}; pass pages this request allocated and still holds") from exc
        owned = self._owned[ordered]
        if np.count_nonzero(owned):
            page = int(ordered[np.argmax(owned)])
            j = int(np.flatnonzero(given == page)[0])
            i = int(where[j]) if where is not None else fp + j
            raise InsertError(
                f"insert: page {page} (page {i} of the key) already belongs to the cache at "
                "another position; pass the request's own pages, or the cache's own page there"
            )
        return dup_idx

    def _page_ids(self, pages: object, what: str) -> np.ndarray:
        if type(pages) is np.ndarray and pages.dtype is _INT64 and pages.ndim == 1:
            return pages
        arr = np.asarray(pages)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise InsertError(f"{what}: need a 1-D integer array of page ids, got shape {arr.shape} {arr.dtype}")
        return arr.astype(np.int64, copy=False)

    def _check_states(self, states: Mapping[int, int] | None, length: int) -> list[tuple[int, int]]:
        if not states:
            return []
        if self.comps.state is None:
            raise InsertError(
                f"insert: states given but this shard ({self.mem.shard.describe()}) has no "
                "recurrent layers; pass states=None"
            )
        ckpts = sorted((int(p), int(s)) for p, s in states.items())
        for pos, _slot in ckpts:
            if pos <= 0 or pos > length or pos % self.page_size:
                raise InsertError(
                    f"insert: state position {pos} must be a multiple of the page size "
                    f"{self.page_size} in 1..{length} (the key's length)"
                )
        slots = np.asarray([s for _, s in ckpts], dtype=np.int64)
        try:
            self.mem.slots.check_live(slots, "insert states")
        except InvalidIds as exc:
            raise InsertError(f"insert: {exc}; pass state slots this request allocated") from exc
        if np.count_nonzero(self._owned_slots[slots]):
            raise InsertError(
                f"insert: state slot {slots[np.argmax(self._owned_slots[slots])]} is already a "
                "cached checkpoint; fork it (fork_state) before handing a copy back"
            )
        return ckpts

    def _adopt_windows(
        self,
        nodes: list[Node],
        partial: Node | None,
        cached: np.ndarray,
        dup_idx: np.ndarray,
        dup_pages: np.ndarray,
    ) -> int:
        """Locked-full recovery: cached pages whose window was evicted take the request's.

        Pages pair by position in the request's row (first occurrence), never by sorting.
        """
        if not self.comps.windows:
            return 0
        seq = [*nodes, partial] if partial is not None else nodes
        ends = np.cumsum([n.pages.size for n in seq])
        starts = ends - np.asarray([n.pages.size for n in seq])
        owner = np.searchsorted(ends, dup_idx, side="right")
        kept = cached[dup_idx]
        adopted = 0
        for w in self.comps.windows:
            pool = self.mem.pools[w.pool_id]
            take = ~pool.resident(kept) & pool.resident(dup_pages)
            if not np.count_nonzero(take):
                continue
            self.mem.adopt_window_pages(dup_pages[take], kept[take], w.pool_id)
            adopted += int(np.count_nonzero(take))
            counts = np.bincount(owner[take], minlength=len(seq))
            for i in np.flatnonzero(counts):
                node = seq[i]
                node.swa_res[w.index] += int(counts[i])
                self._swa_nodes[w.index].add(node)
                self._refresh(node)
                if self.events.enabled:
                    local = dup_idx[take][owner[take] == i] - starts[i]
                    self._emit(EventKind.STORED, w.pool_id, node, local)
        return adopted

    def _attach_states(self, last: Node, ckpts: list[tuple[int, int]]) -> int:
        unused: list[int] = []
        for pos, slot in ckpts:
            node = last
            while node.start >= pos:
                node = node.parent  # type: ignore[assignment]
            if node.end != pos:
                node = self._split(node, pos - node.start)
            if node.state >= 0 or not self._make_room_for_state(node):
                unused.append(slot)
                continue
            node.state = slot
            self._owned_slots[slot] = True
            self._state_nodes.add(node)
            self._refresh(node)
            for below in self._nearest_states_below(node):
                self._refresh(below)  # their previous checkpoint moved closer: a state's key may drop
            if self.events.enabled:
                self._emit_state(EventKind.STORED, node)
        if unused:
            self.mem.free_state(np.asarray(unused, dtype=np.int64))
        return len(unused)

    def _make_room_for_state(self, node: Node) -> bool:
        """Drop checkpoints above ``node`` so its paths stay within the cap; False if locked."""
        above = [a for a in node.path()[:-1] if a.state >= 0]
        excess = len(above) + 1 + self._states_below(node) - self.max_states_per_path
        if excess <= 0:
            return True
        pins = self.mem.gates.slot_pins
        victims = [a for a in above if a.state_lock == 0 and not pins[a.state]]
        if len(victims) < excess:
            self.counters.capped_states += 1
            return False
        victims.sort(key=lambda a: (len(a.children) > 1, a.last_access))
        slots = []
        for victim in victims[:excess]:
            slots.append(victim.state)
            self._drop_state(victim)
        self.mem.free_state(np.asarray(slots, dtype=np.int64))
        self.counters.capped_states += excess
        return True

    @staticmethod
    def _nearest_states_below(node: Node) -> list[Node]:
        """The first checkpoint on every path below ``node``."""
        out, stack = [], list(node.children.values())
        while stack:
            n = stack.pop()
            if n.state >= 0:
                out.append(n)
            else:
                stack.extend(n.children.values())
        return out

    @staticmethod
    def _states_below(node: Node) -> int:
        """Most checkpoints on any path strictly below ``node``."""
        best = 0
        stack = [(c, 0) for c in node.children.values()]
        while stack:
            n, above = stack.pop()
            count = above + (n.state >= 0)
            best = max(best, count)
            stack.extend((c, count) for c in n.children.values())
        return best

    # --- locks ----------------------------------------------------------------------------

    def lock(self, node: Node) -> CacheLock:
        """Protect a hit ending at ``node.end``: full KV on the path, SWA on the window, the
        state checkpoint at ``node`` (if any). Give it back with ``unlock``."""
        if node.dead or node.namespace not in self._roots or self._root_of(node) is not self._roots[node.namespace]:
            raise LockError(f"lock: {node} is not in this cache (evicted, or another cache's node)")
        n: Node | None = node
        while n is not None and n.parent is not None:
            n.lock += 1
            n = n.parent
        span = 0
        n = node
        while self.comps.windows and n.parent is not None and span < self.comps.max_window:
            n.swa_lock += 1
            span += n.end - n.start
            n = n.parent
        state_node = None
        if self.comps.state is not None and node.state >= 0:
            node.state_lock += 1
            state_node = node
        handle = CacheLock(node, span, state_node)
        self._locks.add(handle)
        return handle

    def unlock(self, handle: CacheLock) -> None:
        if not isinstance(handle, CacheLock):
            raise LockError(f"unlock: expected a CacheLock from lock(), got {type(handle).__name__}")
        if handle not in self._locks:
            what = "was already unlocked (double unlock)" if not handle.active else "is not from this cache"
            raise LockError(f"unlock: this lock on {handle.node} {what}")
        n: Node | None = handle.node
        while n is not None and n.parent is not None:
            n.lock -= 1
            n = n.parent
        span = 0
        n = handle.node
        while span < handle.swa_span:
            assert n.parent is not None, "swa span reaches above the root (lock bookkeeping bug)"
            n.swa_lock -= 1
            span += n.end - n.start
            n = n.parent
        if handle.state_node is not None:
            handle.state_node.state_lock -= 1
        handle.active = False
        self._locks.discard(handle)

    @property
    def open_locks(self) -> int:
        return len(self._locks)

    # --- structure ------------------------------------------------------------------------

    def _find_root(self, namespace: Hashable) -> Node | None:
        try:
            return self._roots.get(namespace)
        except TypeError:
            raise CacheError(f"extra_key must be hashable, got {type(namespace).__name__}") from None

    def _root(self, namespace: Hashable) -> Node:
        root = self._find_root(namespace)
        if root is None:
            root = Node(0, b"", _EMPTY, _EMPTY, 0, None, namespace, len(self.comps.windows))
            root.hashes = [root_hash(namespace)]
            self._roots[namespace] = root
        return root

    @staticmethod
    def _root_of(node: Node) -> Node:
        while node.parent is not None:
            node = node.parent
        return node

    def _walk(self, root: Node, toks: np.ndarray) -> tuple[list[Node], Node | None, int]:
        """Fully matched nodes, the node matched part-way (or None), matched tokens (aligned).

        Node keys are compared with the tokens' own memory (``bytes.startswith`` reads the
        slice's buffer): the tokens are never copied whole."""
        ps, total = self.page_size, toks.size
        node, pos, nodes = root, 0, []
        while pos + ps <= total and node.children:
            child = node.children.get(toks[pos : pos + ps].tobytes())
            if child is None:
                break
            kb = child.kb
            n = len(kb) // 8
            if pos + n <= total and kb.startswith(toks[pos : pos + n]):
                nodes.append(child)
                pos += n
                node = child
                continue
            key = child.key
            m = min(key.size, total - pos)
            diff = toks[pos : pos + m] != key[:m]
            i = int(np.argmax(diff)) if np.count_nonzero(diff) else m
            return nodes, child, pos + i - i % ps
        return nodes, None, pos

    def _windows_hold(self, seq: list[Node], end: int) -> bool | None:
        """Whether every window before ``end`` is resident, from per-node counts: None when
        a partly resident node overlaps a window (the pages must tell)."""
        ps = self.page_size
        for w in self.comps.windows:
            first = w.pool_id.first_needed(end) // ps * ps  # start of the first page the window needs
            for n in reversed(seq):
                if n.start >= end:
                    continue
                if n.end <= first:
                    break
                resident = n.swa_res[w.index]
                if resident == n.pages.size:
                    continue
                return False if resident == 0 else None
        return True

    def _walked_pages(self, root: Node, nodes: list[Node], partial: Node | None, full: int) -> np.ndarray:
        """Page ids of the walked ``full`` tokens: a read-only view of the deepest node's path."""
        deepest = partial if partial is not None else nodes[-1] if nodes else root
        return deepest.path_pages[: full // self.page_size]

    def _node_at(self, root: Node, nodes: list[Node], partial: Node | None, end: int) -> Node:
        """The node ending at ``end`` on the walked path, splitting one if needed."""
        if end == 0:
            return root
        if nodes and nodes[-1].end == end:
            return nodes[-1]
        for n in (*nodes, partial):
            if n is None:
                break
            if n.end == end:
                return n
            if n.start < end < n.end:
                return self._split(n, end - n.start)
        raise AssertionError(f"position {end} is not on the walked path (walk bookkeeping bug)")

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after ``k`` tokens; returns the new upper half (``node`` keeps the end)."""
        ps, pb = self.page_size, self._first_page_bytes
        kp = k // ps
        parent = node.parent
        assert parent is not None and 0 < k < node.end - node.start and k % ps == 0
        upper_path = node.path_pages[: (node.start + k) // ps]
        upper = Node(
            next(self._uids),
            node.kb[: k * 8],
            node.pages[:kp],
            upper_path,
            node.start,
            parent,
            node.namespace,
            len(node.swa_res),
        )
        upper.lock, upper.swa_lock = node.lock, node.swa_lock
        upper.last_access, upper.hits = node.last_access, node.hits
        upper.priority, upper.clock = node.priority, node.clock
        if node.hashes is not None:
            upper.hashes, node.hashes = node.hashes[:kp], node.hashes[kp:]
        parent.children[node.kb[:pb]] = upper
        node.kb, node.pages = node.kb[k * 8 :], node.pages[kp:]
        node.start += k
        node.parent = upper
        upper.children[node.kb[:pb]] = node
        for w in self.comps.windows:
            up = int(np.count_nonzero(self.mem.pools[w.pool_id].resident(upper.pages)))
            upper.swa_res[w.index] = up
            node.swa_res[w.index] -= up
            if up:
                self._swa_nodes[w.index].add(upper)
            if not node.swa_res[w.index]:
                self._swa_nodes[w.index].discard(node)
        self.num_nodes += 1
        self._refresh(upper)
        self._refresh(node)
        return upper

    def _add_child(self, parent: Node, kb: bytes, path_pages: np.ndarray) -> Node:
        """A leaf under ``parent`` holding tokens ``kb`` (bytes) on the pages ending ``path_pages``
        (read-only: the tree's own array, hits hand out views of it)."""
        pages = path_pages[parent.path_pages.size :]
        node = Node(
            next(self._uids), kb, pages, path_pages, parent.end, parent, parent.namespace, len(self.comps.windows)
        )
        parent.children[node.kb[: self._first_page_bytes]] = node
        if parent.parent is not None:
            self._leaves.discard(parent)
        self._leaves.add(node)
        self._owned[pages] = True
        self.cached_pages += pages.size
        self.num_nodes += 1
        for w, pool in zip(self.comps.windows, self._window_pools, strict=True):
            node.swa_res[w.index] = int(np.count_nonzero(pool.resident(pages)))
            if node.swa_res[w.index]:
                self._swa_nodes[w.index].add(node)
        if self.events.enabled:
            assert parent.hashes is not None
            node.hashes = chain_hashes(parent.hashes[-1], node.key, self.page_size)
            every = np.arange(pages.size)
            for name in self.comps.history:
                self._emit(EventKind.STORED, name, node, every, with_tokens=True)
            for w in self.comps.windows:
                self._emit(EventKind.STORED, w.pool_id, node, np.flatnonzero(self.mem.pools[w.pool_id].resident(pages)))
        self._refresh(node)
        return node

    def _remove_leaf(self, node: Node, freed: dict[Need, int], release: Release) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        if self.events.enabled:
            for w in self.comps.windows:
                if node.swa_res[w.index]:  # not tombstoned earlier in this eviction
                    resident = self.mem.pools[w.pool_id].resident(node.pages)
                    self._emit(EventKind.REMOVED, w.pool_id, node, np.flatnonzero(resident))
            if node.state >= 0:
                self._emit_state(EventKind.REMOVED, node)
            for name in self.comps.history:
                self._emit(EventKind.REMOVED, name, node, np.arange(node.pages.size))
        del parent.children[node.kb[: self._first_page_bytes]]
        self._leaves.discard(node)
        if parent.parent is not None and not parent.children:
            self._leaves.add(parent)
            self._refresh(parent)
        n = node.pages.size
        for name in self.comps.history:
            freed[name] += n
        freed[PAGE_NEED] += n
        for w in self.comps.windows:
            freed[w.pool_id] += node.swa_res[w.index]
            self._swa_nodes[w.index].discard(node)
        if node.state >= 0:
            assert self.comps.state is not None
            freed[self.comps.state] += 1
            release.slots.append(node.state)
            self._owned_slots[node.state] = False
            self._state_nodes.discard(node)
            node.state = NO_STATE
        release.pages.append(node.pages)
        self._owned[node.pages] = False
        self.cached_pages -= n
        self.counters.evicted_pages += n
        self.num_nodes -= 1
        node.dead = True

    def _drop_state(self, node: Node) -> None:
        if self.events.enabled:
            self._emit_state(EventKind.REMOVED, node)
        self._owned_slots[node.state] = False
        self._state_nodes.discard(node)
        node.state = NO_STATE
        self._refresh(node)

    def _refresh(self, node: Node) -> None:
        """Give every candidate heap ``node`` belongs to an entry with its current key (call
        whenever a key may have dropped; hits only raise keys)."""
        if node in self._leaves:
            self._full.push(node)
        for i, res in enumerate(node.swa_res):
            if res:
                self._swa_heaps[i].push(node)
        if node.state >= 0:
            self._state_heap.push(node)

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

    # --- events ---------------------------------------------------------------------------

    def _emit(self, kind: EventKind, pool: PoolId, node: Node, local: np.ndarray, with_tokens: bool = False) -> None:
        if not local.size:
            return
        assert node.hashes is not None and node.parent is not None and node.parent.hashes is not None
        hashes = tuple(node.hashes[int(i)] for i in local)
        parent_hash = tokens = None
        if with_tokens:
            parent_hash = node.parent.hashes[-1]
            tokens = tuple(int(t) for t in node.key)
        self.events.emit(CacheEvent(kind, str(pool), node.namespace, hashes, parent_hash, tokens))

    def _emit_state(self, kind: EventKind, node: Node) -> None:
        assert node.hashes is not None and self.comps.state is not None
        self.events.emit(CacheEvent(kind, str(self.comps.state), node.namespace, (node.hashes[-1],)))

    # --- reports --------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        c = self.counters
        return {
            "policy": self.policy.name,
            "nodes": self.num_nodes,
            "cached_tokens": self.cached_tokens,
            "window_resident_pages": {
                str(w.pool_id): sum(n.swa_res[w.index] for n in self._swa_nodes[w.index]) for w in self.comps.windows
            },
            "states": self.num_states,
            "open_locks": self.open_locks,
            "matches": c.matches,
            "inserts": c.inserts,
            "duplicate_pages": c.duplicate_pages,
            "adopted_pages": c.adopted_pages,
            "evicted_pages": c.evicted_pages,
            "tombstoned_pages": {str(pool): n for pool, n in c.tombstoned.items()},
            "evicted_states": c.evicted_states,
            "capped_states": c.capped_states,
        }

    def check(self) -> None:
        """Prove the tree's invariants against the memory's host tables (tests, debugging)."""
        from hybridkv.cache.check import check_tree

        check_tree(self)
