"""Loading a hit back from the tiers: plan at admission, fetch while queued, commit once reserved.

    plan = tiers.plan(prefix, namespace, match.length)   # residency of every piece, the cross-tier hit
    fetched = tiers.fetch(plan)                          # store reads start (async); device sources pinned
    ...                                                  # the request waits its turn
    kv = kvm.admit(match); kvm.extend(kv, plan.tokens)   # pages (and the running state slot) reserved first
    end = tiers.commit(fetched, kv.pages, kv.state_slot) # verified bytes copied in; ``end`` is the hit
    tiers.record(plan, end)                              # once the request is admitted for good: stats

``plan`` merges the device's residency (a walk of its tree) with host memory's and the
store's (``exists``), and applies the cross-tier rule (``hit.py``). Pieces beyond the
device's own hit ``D`` come from the cheapest tier holding them: the device itself (its
tree holds full KV or a checkpoint past ``D`` that another component's rule cut off: a
device-to-device copy, pinned until then), host memory or the store.

``commit`` copies nothing unless every piece arrived verified: one miss (a store that
evicted an object on its own after ``exists`` said it was there, a checksum or size that
disagrees, a tier that went down) makes the whole restore fall back to ``D`` (the request
recomputes from there; counted by reason), so a request never runs on a partial or wrong
prefix. Load-back time is counted at the hierarchy's stated bandwidths.

Invariant: ``commit`` returns ``plan.tokens`` or the device hit; the pages it wrote are the
request's own (``[D, E)``), the slot its running state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hybridkv.cache import HybridRadixCache
from hybridkv.cache.events import chain_hashes, root_hash
from hybridkv.memory import MoveGate, UnifiedMemory
from hybridkv.spec import PoolId
from hybridkv.tiers.base import Payload, StorageTier, Ticket, TierError
from hybridkv.tiers.counters import TierCounters
from hybridkv.tiers.device import DeviceView, copy_cells, device_view, write_cells
from hybridkv.tiers.framing import MissReason
from hybridkv.tiers.hit import TIERS, Residency, TierHit, Where, cross_tier_hit
from hybridkv.tiers.host import HostTier
from hybridkv.tiers.keys import KeySpace


class HierarchyView(Protocol):
    """What loading back reads of ``hierarchy.TierHierarchy`` (which writes the tiers and calls these functions)."""

    cache: HybridRadixCache
    mem: UnifiedMemory
    keys: KeySpace
    host: HostTier | None
    store: StorageTier | None
    full_pools: tuple[PoolId, ...]
    window_pools: tuple[PoolId, ...]
    state_pool: PoolId | None
    labels: dict[PoolId, str]
    counters: TierCounters
    timeout_s: float
    bandwidth: dict[Where, float]

    def tier(self, where: Where) -> StorageTier: ...


_STATE = "checkpoint"
_FIRST_CHUNK = 32
"""Pages past the device's named and looked up at first (doubling while every one is found)."""


@dataclass(frozen=True)
class Piece:
    """Objects of one pool restored from one tier."""

    pool: PoolId
    where: Where
    pages: np.ndarray
    """Absolute page index of each object (for a state: the hit's end page)."""
    keys: list[str]
    source: np.ndarray
    """For a device source: the tree's page ids (or the checkpoint's slot); else empty."""


@dataclass
class TierPlan:
    device_tokens: int
    """The device's own hit (locked by the request's handle)."""
    full_tokens: int
    """Where the full KV cached on any tier ends (page-aligned): the branch point, where a
    request computing from the hit should checkpoint its state for the next one."""
    hit: TierHit
    pieces: list[Piece] = field(default_factory=list)
    window_labels: tuple[str, ...] = ()
    moved: Counter[Where] = field(default_factory=Counter)
    """Bytes ``commit`` copied to the device, per source (counted by ``record``)."""

    @property
    def tokens(self) -> int:
        """The cross-tier hit: what ``commit`` restores (at least the device hit)."""
        return max(self.hit.tokens, self.device_tokens)

    @property
    def restores(self) -> bool:
        return self.hit.tokens > self.device_tokens

    def cached_tokens(self, end: int) -> dict[str, int]:
        """A hit of ``end`` tokens (``commit``'s answer) by where its full KV came from: the
        server's ``meta_info.cached_tokens_details`` {device, host, storage}."""
        out = {"device": end, "host": 0, "storage": 0}
        if end > self.device_tokens:
            by_tier = self.hit.full_tokens()
            out = {"device": by_tier[Where.DEVICE], "host": by_tier[Where.HOST], "storage": by_tier[Where.STORE]}
        return out


@dataclass
class Fetched:
    plan: TierPlan
    gate: MoveGate | None
    store: list[tuple[Piece, Ticket[list[Payload | MissReason]]]]


def _lookup(h: HierarchyView, pool: PoolId, names: list[int], idx: np.ndarray) -> np.ndarray:
    """Tier codes (host, else store, else nowhere) of the objects of pages ``idx``."""
    out = np.full(idx.size, Where.NOWHERE, dtype=np.int8)
    if not idx.size:
        return out
    keys = h.keys.keys(pool, [names[i] for i in idx])
    todo = np.arange(idx.size)
    if h.host is not None:
        found = h.host.exists(keys)
        out[found] = Where.HOST
        h.host.touch([k for k, f in zip(keys[::-1], found[::-1], strict=True) if f])  # the first page most recent
        todo = np.flatnonzero(~found)
    if h.store is not None and todo.size:
        found = h.store.exists([keys[i] for i in todo])
        out[todo[found]] = Where.STORE
    return out


def plan(h: HierarchyView, tokens: np.ndarray, namespace: Hashable, device_tokens: int) -> TierPlan:
    """Where every piece of ``tokens``' longest restorable prefix is (``device_tokens``: the
    device's own hit for the same tokens, ``MatchResult.length``). Pages past the device's are
    named and looked up in growing chunks, up to the first page no tier holds full KV of."""
    ps = h.keys.page_size
    n = tokens.size // ps
    dev = device_view(h.cache, tokens, namespace)
    nd = dev.pages.size
    names = dev.names if dev.names is not None else h.keys.page_names(tokens[: nd * ps], namespace)
    best = {}
    for p in h.full_pools:
        best[p] = np.full(n, Where.NOWHERE, dtype=np.int8)
        best[p][:nd] = Where.DEVICE
    pos, chunk = nd, _FIRST_CHUNK
    while pos < n:
        stop = min(n, pos + chunk)
        names += chain_hashes(names[-1] if names else root_hash(namespace), tokens[pos * ps : stop * ps], ps)
        idx = np.arange(pos, stop)
        missing = np.zeros(idx.size, dtype=bool)
        for p in h.full_pools:
            best[p][pos:stop] = _lookup(h, p, names, idx)
            missing |= best[p][pos:stop] == Where.NOWHERE
        if missing.any():
            break
        pos, chunk = stop, chunk * 2
    full = np.max(np.stack(list(best.values())), axis=0) if best else np.full(n, Where.DEVICE, dtype=np.int8)
    gaps = np.flatnonzero(full == Where.NOWHERE)
    reach = int(gaps[0]) if gaps.size else n
    windows = []
    for pool, resident in zip(h.window_pools, dev.window_resident, strict=True):
        where = np.full(n, Where.NOWHERE, dtype=np.int8)
        where[:nd][resident] = Where.DEVICE
        missing = np.flatnonzero(where[:reach] == Where.NOWHERE)
        where[missing] = _lookup(h, pool, names, missing)
        best[pool] = where
        windows.append(where)
    ckpts = None
    if h.state_pool is not None:
        ckpts = np.full(n + 1, Where.NOWHERE, dtype=np.int8)
        for e in dev.checkpoints:
            ckpts[e] = Where.DEVICE
        ends = np.flatnonzero(ckpts[1 : reach + 1] == Where.NOWHERE) + 1
        ckpts[ends] = _lookup(h, h.state_pool, names, ends - 1)
    hit = cross_tier_hit(Residency(full, tuple(windows), ckpts), ps, h.window_pools, n)
    labels = tuple(h.labels[p] for p in h.window_pools)
    out = TierPlan(device_tokens, reach * ps, hit, window_labels=labels)
    if not out.restores:
        return out
    d, e = device_tokens // ps, hit.pages
    for p in h.full_pools:
        out.pieces += _pieces(h, p, best[p], np.arange(d, e), names, dev)
    for p, (first, _) in zip(h.window_pools, hit.windows, strict=True):
        if (best[p][first:d] != Where.DEVICE).any():
            raise TierError(f"tier plan: window pool {p} lost pages of the device hit's window (a locking bug)")
        out.pieces += _pieces(h, p, best[p], np.arange(max(first, d), e), names, dev)
    if h.state_pool is not None and hit.checkpoint is not None:
        state = hit.checkpoint
        key = h.keys.keys(h.state_pool, [names[e - 1]])
        src = np.array([dev.checkpoints[e]] if state is Where.DEVICE else [], dtype=np.int64)
        out.pieces.append(Piece(h.state_pool, state, np.array([e]), key, src))
    return out


def _pieces(
    h: HierarchyView, pool: PoolId, where: np.ndarray, idx: np.ndarray, names: list[int], dev: DeviceView
) -> list[Piece]:
    out = []
    for tier in TIERS:
        pages = idx[where[idx] == tier]
        if not pages.size:
            continue
        src = dev.pages[pages] if tier is Where.DEVICE else np.empty(0, dtype=np.int64)
        keys = [] if tier is Where.DEVICE else h.keys.keys(pool, [names[i] for i in pages])
        out.append(Piece(pool, tier, pages, keys, src))
    return out


def fetch(h: HierarchyView, plan: TierPlan) -> Fetched:
    """Start the store's reads; pin the device's sources past the device hit."""
    if not plan.restores:
        return Fetched(plan, None, [])
    dev = [p for p in plan.pieces if p.where is Where.DEVICE]
    pages = [p.source for p in dev if p.pool != h.state_pool]
    slots = [p.source for p in dev if p.pool == h.state_pool]
    gate = None
    if pages or slots:
        gate = h.mem.pin(
            pages=np.unique(np.concatenate(pages)) if pages else None,
            slots=np.concatenate(slots) if slots else None,
        )
    store = []
    for piece in plan.pieces:
        if piece.where is Where.STORE:
            size = h.keys.payload_bytes[piece.pool]
            store.append((piece, h.tier(Where.STORE).submit_get(piece.keys, [size] * len(piece.keys))))
    return Fetched(plan, gate, store)


def commit(h: HierarchyView, fetched: Fetched, pages: np.ndarray, slot: int | None) -> int:
    """Copy the plan's pieces into the request's ``pages`` (its page ids from token 0) and
    running state ``slot``; returns the hit now valid (the plan's, or the device hit)."""
    plan = fetched.plan
    ps = h.keys.page_size
    d, e = plan.device_tokens // ps, plan.hit.pages
    try:
        if not plan.restores:
            return plan.device_tokens
        if pages.size < e:
            raise TierError(f"commit: the request holds {pages.size} pages; reserve {e} (extend to {plan.tokens})")
        if h.state_pool is not None and slot is None:
            raise TierError("commit: a state checkpoint is restored into the running state slot; pass it")
        got = _gather(h, fetched)
        if got is None:
            h.counters.fallbacks += 1
            return plan.device_tokens
        moved = plan.moved
        moved.clear()
        for piece, payloads in got:
            dst = np.array([slot], dtype=np.int64) if piece.pool == h.state_pool else pages[piece.pages]
            if piece.where is Where.DEVICE:
                copy_cells(h.mem, piece.pool, piece.source, dst)
            else:
                write_cells(h.mem, piece.pool, dst, payloads)
            moved[piece.where] += dst.size * h.keys.payload_bytes[piece.pool]
        assert e > d
        return plan.tokens
    finally:
        if fetched.gate is not None:
            fetched.gate.release()


def _gather(h: HierarchyView, fetched: Fetched) -> list[tuple[Piece, list[Payload]]] | None:
    """Every piece's verified payloads, or None (counted by reason) if any is missing."""
    out: list[tuple[Piece, list[Payload]]] = []
    misses: Counter[str] = Counter()
    store = {id(piece): ticket for piece, ticket in fetched.store}
    for piece in fetched.plan.pieces:
        if piece.where is Where.DEVICE:
            out.append((piece, []))
            continue
        size = h.keys.payload_bytes[piece.pool]
        ticket = store.get(id(piece))
        try:
            if ticket is not None:
                results = ticket.wait(h.timeout_s)
            else:
                results = h.tier(piece.where).get(piece.keys, [size] * len(piece.keys))
        except TierError:
            results = [MissReason.TIMEOUT] * len(piece.keys)
        payloads = []
        for r in results:
            if isinstance(r, MissReason):  # the plan saw it there: absent now means evicted since
                misses[(MissReason.EVICTED if r is MissReason.ABSENT else r).value] += 1
            else:
                payloads.append(r)
        out.append((piece, payloads))
    if misses:
        h.counters.misses.update(misses)
        return None
    return out


def record(h: HierarchyView, plan: TierPlan, end: int) -> None:
    """Count a request's hit of ``end`` tokens (what ``commit`` returned) by component and
    source tier: once per request, when it is admitted for good."""
    ps, c = h.keys.page_size, h.counters
    hit = plan.hit
    d = plan.device_tokens // ps
    restored = end > plan.device_tokens
    e = hit.pages if restored else d

    def add(label: str, where: np.ndarray) -> None:
        counts = c.hit_tokens.setdefault(label, Counter())
        for tier in TIERS:
            n = int(np.count_nonzero(where == tier)) * ps
            if n:
                counts[tier.name.lower()] += n

    full = np.full(e, Where.DEVICE, dtype=np.int8)
    full[d:e] = hit.full[d:e]
    add("full_kv", full)
    for pool, label, (_, where) in zip(h.window_pools, plan.window_labels, hit.windows, strict=True):
        if restored:
            add(f"window:{label}", where)
        else:  # the device hit's own window
            first = int(pool.first_needed(d * ps)) // ps
            add(f"window:{label}", np.full(d - first, Where.DEVICE, dtype=np.int8))
    if h.state_pool is not None and e:
        src = hit.checkpoint if restored and hit.checkpoint is not None else Where.DEVICE
        c.hit_tokens.setdefault(_STATE, Counter())[src.name.lower()] += e * ps
    if restored:
        c.restored_tokens += (e - d) * ps
        c.restored_requests += 1
        for source, n in plan.moved.items():
            c.loaded_bytes[source.name.lower()] += n
            if source is not Where.DEVICE:
                c.load_seconds += n / h.bandwidth[source]
