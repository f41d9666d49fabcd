"""The engine's tiers below the device: host memory and the Mooncake Store, restored at admission.

``EngineTiers`` hangs a ``TierHierarchy`` below the allocator's prefix cache (write-back by
default: what the device evicts goes to host memory, what host memory evicts to the store)
and drives a request's hit across the tiers:

    fetched = tiers.plan(key, ns, kvm.match(key, ns))    # queued: plan, store reads start
    fetched = tiers.current(fetched, key, ns, match)     # admission: re-planned if the device hit moved
    handle, end = tiers.restore(handle, match, fetched)  # pages reserved, then the bytes copied in

``restore`` grows the admitted handle to the planned end chunk by chunk (pages reserved
before any copy), frees the window cells no tier brought back (only the window before the
end is restored: ``KVManager.discard_windows``), commits, and makes a state that came from
host memory or the store a device checkpoint again (the next hit is local). A restore that
misses an object (evicted by the store on its own, a checksum or size that disagrees, a tier
that went down) or finds no room falls back: the handle is released and the request
re-admitted on its device hit, holding nothing of the failed restore, and computes the rest.

On a multi-rank engine (a prefill engine's PP stages x TP ranks) every rank has its own tiers,
keyed by its shard (``tiers.keys``), and ``agreed`` / ``restore`` take the engine's
``Agreement``: each rank plans its longest restorable prefix, the ranks agree on the shortest
(re-planning that prefix until every rank can restore exactly it), reserve (one "room" flag
agreed) and copy; one rank's miss (checksum, size, evicted, tier down) makes every rank fall
back to the agreed device hit. Every rank makes the same agreement calls whatever it found.

A ``mooncake`` store without a master address starts one on loopback (``MooncakeMaster``),
stopped by ``close``. Store keys name the model by its spec (``tiers.keys``): engines that
share a master must serve the same weights under the same spec name.

Host reads of device memory: none on the forward path. Write-back copies a cell out when the
cache evicts it and a restore copies cells in at admission; on CPU both are host memory. On
CUDA they would go through pinned buffers (``HostTier`` pins there; the store's staging
buffers would need pinning too) on a side stream with an event per copy, where today
``tiers.device.read_cells`` synchronises the current stream.

Invariant: a request starts computing at the hit ``restore`` returns, and every byte it reads
before that position was computed by the model for exactly those tokens (verified frames,
or the device's own cells).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from typing import Any

import numpy as np

from hybridkv.cache import KVHandle, KVManager, MatchResult
from hybridkv.engine.sched.agreement import ALONE, Agreement
from hybridkv.memory import OutOfMemory, parse_bytes
from hybridkv.tiers import (
    Fetched,
    HostTier,
    MooncakeMaster,
    MooncakeStoreTier,
    StorageTier,
    TierHierarchy,
    Where,
    WritePolicy,
)

ZERO_DETAILS = {"device": 0, "host": 0, "storage": 0}


class EngineTiers:
    def __init__(self, kvm: KVManager, hierarchy: TierHierarchy, chunk_tokens: int, master: MooncakeMaster | None):
        self.kvm = kvm
        self.hierarchy = hierarchy
        self.chunk = max(chunk_tokens, kvm.page_size)
        self.master = master
        """The loopback master this engine started (None: an operator's, or no store)."""
        self.fallbacks: dict[str, int] = {"no_room": 0, "peer": 0}
        """Restores given up, by reason: no room here, or another rank's (no room, or a miss);
        this rank's own misses are the hierarchy's."""

    @classmethod
    def build(
        cls,
        kvm: KVManager,
        chunk_tokens: int,
        *,
        host_memory: int | str | None = None,
        store: str | StorageTier = "none",
        store_master: str | None = None,
        store_memory: int | str = "256MiB",
        policy: str = WritePolicy.BACK.value,
    ) -> EngineTiers | None:
        """The tiers the options ask for (None: the device only), as an ``EngineConfig`` checked them.
        ``store``: ``none``, ``mooncake`` (a client of ``store_master``, or of a master started here
        on loopback) or a ``StorageTier`` the caller built (it is closed with the engine)."""
        if host_memory is None and store == "none":
            return None
        master = None
        host = HostTier(host_memory) if host_memory is not None else None
        tier: StorageTier | None = None
        try:
            if store == "mooncake":
                if store_master is None:
                    master = MooncakeMaster().start()
                    store_master = master.address
                segment = parse_bytes(store_memory) if isinstance(store_memory, str) else store_memory
                tier = MooncakeStoreTier(store_master, segment_bytes=segment)
            elif isinstance(store, StorageTier):
                tier = store
            return cls(kvm, TierHierarchy(kvm.cache, host=host, store=tier, policy=policy), chunk_tokens, master)
        except BaseException:
            if tier is not None and tier is not store:
                tier.close()
            if master is not None:
                master.stop()
            raise

    # --- one request ------------------------------------------------------------------------

    def plan(self, key: np.ndarray, namespace: Hashable, match: MatchResult) -> Fetched | None:
        """The cross-tier hit of ``key`` beyond the device's ``match``, its reads started; None
        when the tiers add nothing to the device hit."""
        fetched = self.hierarchy.fetch(self.hierarchy.plan(key, namespace, match.length))
        return fetched if fetched.plan.restores else None

    def current(
        self, fetched: Fetched | None, key: np.ndarray, namespace: Hashable, match: MatchResult
    ) -> Fetched | None:
        """``fetched`` if it was planned on the same device hit as ``match``; else a new plan."""
        if fetched is not None and fetched.plan.device_tokens == match.length:
            return fetched
        self.cancel(fetched)
        return self.plan(key, namespace, match)

    def cancel(self, fetched: Fetched | None) -> None:
        if fetched is not None:
            self.hierarchy.cancel(fetched)

    def agreed(
        self, fetched: Fetched | None, key: np.ndarray, namespace: Hashable, match: MatchResult, agree: Agreement
    ) -> tuple[Fetched | None, int]:
        """The cross-tier hit every rank of ``agree`` can restore (``current``, then: agree on the
        shortest, re-plan that prefix where a rank planned more, until all agree; a rank's shorter
        prefix may hold no checkpoint or window at that length, so its plan may drop further), and
        the full KV cached on every rank's tiers past it (``branch_at``). Every rank ends with the
        same ``plan.tokens`` (None on all when the tiers add nothing to the agreed device hit)."""
        fetched = self.current(fetched, key, namespace, match)
        while True:
            mine = match.length if fetched is None else fetched.plan.tokens
            full = 0 if fetched is None else fetched.plan.full_tokens
            shortest, longest, full = agree.min([mine, -mine, full])
            if shortest == -longest:
                return fetched, full
            if mine > shortest:
                self.cancel(fetched)
                fetched = self.plan(key[:shortest], namespace, match)

    def restore(
        self, handle: KVHandle, match: MatchResult, fetched: Fetched, agree: Agreement = ALONE
    ) -> tuple[KVHandle, int]:
        """Reserve ``handle``'s pages up to the planned end and copy the pieces in; the handle
        (a new one, re-admitted on ``match``, when the restore fell back) and its hit. Every rank
        of ``agree`` restores, or all fall back (no room, or an object missing on any rank)."""
        kvm, plan = self.kvm, fetched.plan
        room = 1
        try:
            pos = handle.seq_len
            while pos < plan.tokens:
                pos = min(plan.tokens, pos + self.chunk)
                kvm.extend(handle, pos)
                kvm.discard_windows(handle)
        except OutOfMemory:
            room = 0
        if not agree.min([room])[0]:
            self.cancel(fetched)
            self.fallbacks["no_room" if not room else "peer"] += 1
            return self._readmit(handle, match, agree)
        end = self.hierarchy.commit(fetched, handle.pages, handle.state_slot)
        if not agree.min([int(end == plan.tokens)])[0]:  # an object missing or damaged (counted by reason): recompute
            if end == plan.tokens:
                self.fallbacks["peer"] += 1  # another rank missed: this one's copy is dropped with the handle
            return self._readmit(handle, match, agree)
        if handle.state_slot is not None:
            handle.adopt_state(handle.state_slot)  # it holds the state after ``end`` tokens now
            if plan.hit.checkpoint is not Where.DEVICE:
                with contextlib.suppress(OutOfMemory):  # no room: the state stays below only
                    kvm.checkpoints.take(handle)
        self.hierarchy.record(plan, end)
        return handle, end

    def _readmit(self, handle: KVHandle, match: MatchResult, agree: Agreement) -> tuple[KVHandle, int]:
        """Release ``handle`` and admit ``match`` again on every rank, or on none (``OutOfMemory``)."""
        self.kvm.release(handle)
        again = None
        with contextlib.suppress(OutOfMemory):
            again = self.kvm.admit(match, handle.namespace)
        if not agree.min([int(again is not None)])[0]:
            if again is not None:
                self.kvm.release(again)
            raise OutOfMemory(f"no room to admit the device hit of {match.length} tokens again after a restore")
        assert again is not None
        return again, match.length

    @staticmethod
    def branch_at(full: int, start: int, device_branch: int | None) -> int | None:
        """Where the full KV cached on any tier ends past ``start`` (``full``: what ``agreed``
        answered; the placement's branch point), or None."""
        full = max(full, device_branch or 0)
        return full if full > start else None

    @staticmethod
    def details(fetched: Fetched | None, start: int) -> dict[str, int]:
        """A hit of ``start`` tokens by where its full KV came from: device, host, storage."""
        if fetched is None or start <= fetched.plan.device_tokens:
            return {**ZERO_DETAILS, "device": start}
        return fetched.plan.cached_tokens(start)

    # --- the engine's life ------------------------------------------------------------------

    def step(self) -> None:
        """Count the writes that finished (once per engine step; never waits)."""
        self.hierarchy.reap()

    def clear_host(self) -> None:
        """Empty host memory into the store below (write-back), and wait for those writes."""
        if self.hierarchy.host is not None:
            self.hierarchy.host.clear()
        self.hierarchy.reap(wait=True)

    def metrics(self) -> dict[str, Any]:
        h = self.hierarchy
        c = h.counters
        out: dict[str, Any] = {
            "policy": h.policy.value,
            "written_bytes": dict(c.written_bytes),
            "write_refused": dict(c.write_refused),
            "write_around": dict(c.write_around),
            "loaded_bytes": dict(c.loaded_bytes),
            "restored_tokens": c.restored_tokens,
            "restored_requests": c.restored_requests,
            "misses": dict(c.misses),
            "fallbacks": c.fallbacks + sum(self.fallbacks.values()),
            "hit_tokens": {k: dict(v) for k, v in c.hit_tokens.items()},
        }
        if h.host is not None:
            out["host"] = {**h.host.usage(), **h.host.stats.as_dict()}
        if h.store is not None:
            out["store"] = {"name": h.store.name, "up": h.store.up, **h.store.stats.as_dict()}
        return out

    def close(self) -> None:
        try:
            self.hierarchy.close()
        finally:
            if self.master is not None:
                self.master.stop()
