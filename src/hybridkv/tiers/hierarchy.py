"""The tier hierarchy below one device: device -> host memory -> store, and its write policies.

``TierHierarchy`` is the prefix cache's ``ResidencyHook``: the cache tells it what its tree
stores and, before the bytes are freed, what it evicts. What it writes per component:
- full KV: every page of the node, every full-history pool (one object per page and pool);
- a window pool: only the pages of the window before a boundary where a hit may end, those
  still resident: the node's end (a hit ends where a node ends or is split) or, with
  ``window_align``, its end rounded down to a multiple of it (prompts that share content
  only in whole blocks of that many tokens, as a replayed trace's, end their hits there);
  with ``window_stride``, also every multiple of it inside the node (more hits can end
  below, for more bytes: a stride at most the window writes every page);
- a checkpoint: the slot's cell, named by the node's last page.

Write policies:
- ``back`` (default): written when the device evicts them, to host memory (or to the store
  when there is no host tier); what host memory evicts goes on to the store;
- ``through``: written to every tier below as soon as the device caches them; evictions
  then write nothing (the tiers below hold it already).

An object larger than host memory's whole budget (a recurrent-state checkpoint of a real model is
tens of MiB per rank) goes around it, straight to the store (``write_around``, counted per
component); without a store it is refused and counted as refused by host memory, never dropped
silently. Objects a tier holds already are not written again (keys name content). Writes to a
networked store are not waited for: their tickets are reaped later (``reap``) and counted.
At most ``max_pending_bytes`` of frames (plus one batch) wait in unfinished writes: past that
(a store slower than the evictions feeding it) a write is dropped and counted as refused, so
a slow or hung store never holds an unbounded amount of host memory. A tier that completes
writes at once (host memory, a dict) never has a backlog.

Loading back (``restore.py``) and the hit rule (``hit.py``) read what this writes.

Invariants:
- A hook call copies the bytes out before it returns: the cache frees them after.
- Keys are ``KeySpace`` keys of this memory's shard; nothing else is ever written.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from enum import StrEnum

import numpy as np
import torch

import hybridkv.tiers.restore as restore
from hybridkv.cache import ComponentKind, HybridRadixCache, Node
from hybridkv.spec import PoolId
from hybridkv.tiers.base import PutStatus, StorageTier, Ticket, TierError
from hybridkv.tiers.counters import TierCounters
from hybridkv.tiers.device import read_cells
from hybridkv.tiers.framing import HEADER, meta_frame, write_header
from hybridkv.tiers.hit import Where
from hybridkv.tiers.host import HostTier
from hybridkv.tiers.keys import KeySpace
from hybridkv.tiers.restore import Fetched, TierPlan


class WritePolicy(StrEnum):
    BACK = "back"
    THROUGH = "through"


NO_BOUNDARY = np.iinfo(np.int64).max


class TierHierarchy:
    def __init__(
        self,
        cache: HybridRadixCache,
        *,
        host: HostTier | None = None,
        store: StorageTier | None = None,
        policy: WritePolicy | str = WritePolicy.BACK,
        host_bandwidth: float = 25e9,
        store_bandwidth: float = 10e9,
        timeout_s: float = 10.0,
        window_stride: int = 0,
        window_align: int = 0,
        max_pending_bytes: int = 1 << 30,
    ):
        if host is None and store is None:
            raise TierError("a tier hierarchy needs host memory, a store, or both")
        if host is not None and host.on_evict is not None:
            raise TierError("this host tier already belongs to a hierarchy (its on_evict is set)")
        ps = cache.page_size
        for name, value in (("window_stride", window_stride), ("window_align", window_align)):
            if isinstance(value, bool) or not isinstance(value, int) or value % ps or value < 0:
                raise TierError(f"{name} must be 0 or a positive multiple of the page size {ps}, got {value!r}")
        if host_bandwidth <= 0 or store_bandwidth <= 0:
            raise TierError(f"bandwidths must be > 0 B/s, got host {host_bandwidth} store {store_bandwidth}")
        self.cache = cache
        self.mem = cache.mem
        self.rules = cache.rules
        self.keys = KeySpace.of(self.mem)
        self.host = host
        self.store = store
        self.policy = WritePolicy(policy)
        self.bandwidth = {Where.HOST: float(host_bandwidth), Where.STORE: float(store_bandwidth)}
        self.timeout_s = timeout_s
        self.window_stride = window_stride
        self.window_align = window_align
        self.counters = TierCounters()
        self._pending: list[tuple[str, Ticket[list[PutStatus]], int, int]] = []
        """Unfinished writes: tier name, ticket, frame bytes, objects."""
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.full_pools: tuple[PoolId, ...] = self.rules.full.pools
        self.window_pools: tuple[PoolId, ...] = tuple(w.pool_id for w in self.rules.windows)
        self.state_pool: PoolId | None = self.rules.checkpoint.pool_id if self.rules.checkpoint is not None else None
        self.labels = {p: str(p) for p in self.mem.pools}
        if host is not None:
            host.on_evict = self._host_evicted
        cache.set_residency_hook(self)

    def tier(self, where: Where) -> StorageTier:
        got = self.host if where is Where.HOST else self.store if where is Where.STORE else None
        if got is None:
            raise TierError(f"no {where.name.lower()} tier here")
        return got

    @property
    def first_tier(self) -> StorageTier:
        """Where the device writes: host memory, or the store without one."""
        tier = self.host if self.host is not None else self.store
        assert tier is not None
        return tier

    # --- the cache's hook -----------------------------------------------------------------

    def stored(self, node: Node, kind: ComponentKind, pool: PoolId | None) -> None:
        if self.policy is WritePolicy.THROUGH:
            for tier in (self.host, self.store):
                if tier is not None:
                    self._write(node, kind, pool, tier)

    def evicting(self, node: Node, kind: ComponentKind, pool: PoolId | None) -> None:
        if self.policy is WritePolicy.BACK:
            self._write(node, kind, pool, self.first_tier)

    def _write(self, node: Node, kind: ComponentKind, pool: PoolId | None, tier: StorageTier) -> None:
        assert node.hashes is not None
        names = node.hashes
        if kind is ComponentKind.CHECKPOINT:
            assert pool is not None
            self._put(tier, pool, np.array([node.checkpoint], dtype=np.int64), [names[-1]])
        elif kind is ComponentKind.FULL_KV:
            for p in self.full_pools:
                self._put(tier, p, node.pages, names)
        else:
            assert pool is not None
            local = self._window_pages(node, pool)
            local = local[self.mem.resident(node.pages[local], pool)]
            self._put(tier, pool, node.pages[local], [names[i] for i in local])

    def _window_pages(self, node: Node, pool: PoolId) -> np.ndarray:
        """Indices of ``node``'s pages inside the window before a boundary where a hit may end: its
        end (rounded down to a multiple of ``window_align``) and every multiple of ``window_stride``
        inside it. A page is needed when the first boundary at or after its end reaches back to it."""
        ps, stride, align = self.keys.page_size, self.window_stride, self.window_align
        ends = (node.start // ps + np.arange(1, node.pages.size + 1)) * ps  # each page's end position
        last = node.end // align * align if align else node.end
        nxt = np.where(ends <= last, last, NO_BOUNDARY)
        if stride:
            multiple = -(-ends // stride) * stride
            nxt = np.minimum(nxt, np.where(multiple <= node.end, multiple, NO_BOUNDARY))
        bounded = nxt != NO_BOUNDARY
        reach = np.asarray(pool.first_needed(np.where(bounded, nxt, ends)))
        return np.flatnonzero(bounded & (reach <= ends - ps))

    def _put(self, tier: StorageTier, pool: PoolId, ids: np.ndarray, names: list[int]) -> None:
        """Write the objects of pages ``ids`` (named ``names``), last page first: in an LRU
        tier the first pages of a run stay longest (a prefix is worth nothing without them)."""
        if not ids.size:
            return
        ids, names = ids[::-1], names[::-1]
        keys = self.keys.keys(pool, names)
        size = HEADER + self.keys.payload_bytes[pool]
        if tier is self.host and size > self.host.budget:  # it can never hold one: around it, or refused
            if self.store is None or self.policy is WritePolicy.THROUGH:  # (through: the store gets its own write)
                self.counters.write_refused[tier.name] += len(keys)
                return
            self.counters.write_around[self.labels[pool]] += len(keys)
            tier = self.store
        if not self.mem.arena.has_data:  # a replay: sizes only (a tier keeps what it holds, as KEPT)
            frames = [meta_frame(size)] * len(keys)
        else:
            if tier is self.host:  # local: copy out only what it lacks; what it holds is recently used now
                fresh = ~tier.exists(keys)
                if not fresh.all():
                    self.host.touch([k for k, f in zip(keys, fresh, strict=True) if not f])
                    ids, keys = ids[fresh], [k for k, f in zip(keys, fresh, strict=True) if f]
                    if not keys:
                        return
            if isinstance(tier, HostTier):
                frames = [tier.buffer(size) for _ in keys]
            else:
                frames = [torch.empty(size, dtype=torch.uint8) for _ in keys]
            read_cells(self.mem, pool, ids, frames)
            for key, frame in zip(keys, frames, strict=True):
                write_header(frame, key)
        self._submit(tier, keys, frames, self.labels[pool])

    def _submit(self, tier: StorageTier, keys: list[str], frames: list[torch.Tensor], label: str) -> None:
        size = frames[0].numel() if frames else 0
        self.reap()
        if self.pending_bytes and self.pending_bytes + size * len(keys) > self.max_pending_bytes:
            self.counters.write_refused[tier.name] += len(keys)  # a backlog: the tier is slower than the writes
            return
        ticket = tier.submit_put(keys, frames, label)
        self._pending.append((tier.name, ticket, size, len(keys)))
        self.pending_bytes += size * len(keys)
        self.reap()

    def _host_evicted(self, keys: list[str], frames: list[torch.Tensor], labels: list[str]) -> None:
        """Host memory evicted these: write them back to the store (``back``; under
        ``through`` the store has them already)."""
        if self.store is None or self.policy is not WritePolicy.BACK:
            return
        by_label: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
        for key, frame, label in zip(keys, frames, labels, strict=True):
            ks, fs = by_label.setdefault(label, ([], []))
            ks.append(key)
            fs.append(frame)
        for label, (ks, fs) in by_label.items():
            self._submit(self.store, ks, fs, label)

    # --- loading back (restore.py) --------------------------------------------------------

    def plan(self, tokens: np.ndarray, namespace: Hashable = None, device_tokens: int = 0) -> TierPlan:
        """The cross-tier hit for ``tokens`` (the prefix a hit may cover) and where each piece is."""
        return restore.plan(self, tokens, namespace, device_tokens)

    def fetch(self, plan: TierPlan) -> Fetched:
        """Start the store's reads for ``plan``; pin its device sources."""
        return restore.fetch(self, plan)

    def commit(self, fetched: Fetched, pages: np.ndarray, slot: int | None) -> int:
        """Copy the fetched pieces into the request's reserved ``pages`` / ``slot``; the hit now valid."""
        return restore.commit(self, fetched, pages, slot)

    def cancel(self, fetched: Fetched) -> None:
        """Drop a fetch that will not be committed (re-planned, or its request ended): its device
        sources are unpinned; the store's reads finish on their own and are discarded."""
        if fetched.gate is not None:
            fetched.gate.release()

    def record(self, plan: TierPlan, end: int) -> None:
        """Count a request's hit (``commit``'s answer) by component and source tier, once."""
        restore.record(self, plan, end)

    def reap(self, wait: bool = False) -> None:
        """Count the writes that finished (all of them, waiting up to the timeout, with ``wait``)."""
        keep = []
        c = self.counters
        for name, ticket, size, count in self._pending:
            if not (wait or ticket.poll()):
                keep.append((name, ticket, size, count))
                continue
            self.pending_bytes -= size * count
            try:
                statuses = ticket.wait(self.timeout_s)
            except TierError:  # timed out: the tier is marked down, these writes count as lost
                c.write_refused[name] += count
                continue
            counts = Counter(statuses)
            stored = counts.pop(PutStatus.STORED, 0)
            c.written_objects[name] += stored
            c.written_bytes[name] += stored * size
            counts.pop(PutStatus.KEPT, None)
            if counts:
                c.write_refused[name] += sum(counts.values())
        self._pending = keep

    def close(self) -> None:
        self.reap(wait=True)
        self.cache.set_residency_hook(None)
        for tier in (self.host, self.store):
            if tier is not None:
                tier.close()
