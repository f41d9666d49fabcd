"""The replay's tier layer: host memory and a store below the simulated device.

With ``ReplayConfig.tiers`` set, the simulator's prefix cache hangs a ``TierHierarchy``
below it (write-back by default: what the device evicts goes to host memory, what host
memory evicts to the store). At admission a request's hit is the cross-tier hit: the
device's match is planned against the tiers (``plan``), the request reserves its pages up
to the restored end like a prefill would (chunk by chunk, releasing pages that left each
window) and the pieces are committed (``restore``); a restored checkpoint is cached on the
device again. Tables only, like the rest of the replay: host memory and the simulated store
hold sizes (meta frames), the Mooncake Store holds objects of the true size (zero payloads
with real headers, checksummed on the way back).

Load-back time is the restored bytes at the stated bandwidths (host -> device, store ->
device); the simulated clock pays it instead of recomputing those tokens.

Invariant: a request whose restore fell back (an object missing when read) is re-admitted
on its device hit, holding nothing of the failed restore.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridkv.cache import KVHandle, KVManager, MatchResult
from hybridkv.memory import OutOfMemory, parse_bytes
from hybridkv.tiers import (
    DictStore,
    Fetched,
    HostTier,
    MooncakeMaster,
    MooncakeStoreTier,
    StorageTier,
    TierHierarchy,
    Where,
    WritePolicy,
)

STORES = ("none", "sim", "mooncake")


@dataclass(frozen=True)
class TierConfig:
    host_memory: str | int | None = None
    """Host memory below the device (bytes or e.g. "512GiB"); None: no host tier."""
    store: str = "none"
    """``none``, ``sim`` (a simulated store: sizes only, evicting its oldest objects when
    full) or ``mooncake`` (the real Mooncake Store)."""
    store_memory: str | int | None = None
    """The store's capacity: ``sim``: None is unbounded; ``mooncake``: the segment this
    client mounts (default 1GiB)."""
    store_master: str | None = None
    """``mooncake``: an operator's master (host:port); None starts one on loopback."""
    write_policy: str = WritePolicy.BACK.value
    window_stride: int = 0
    """Windows written below the device: before each node's end, and (when > 0) before every
    multiple of this many tokens (``TierHierarchy.window_stride``)."""
    window_align: int = 0
    """When > 0, the window before each node's end is the one before its end rounded down to a
    multiple of this many tokens (the blocks a trace's prompts share content in:
    ``TierHierarchy.window_align``)."""
    host_bandwidth: float = 25e9
    """Bytes/s from host memory to the device (PCIe-class)."""
    store_bandwidth: float = 10e9
    """Bytes/s from the store to the device (RDMA-class)."""

    def __post_init__(self) -> None:
        if self.store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {self.store!r}")
        if self.host_memory is None and self.store == "none":
            raise ValueError("tiers need host memory, a store, or both")
        WritePolicy(self.write_policy)

    def describe(self) -> str:
        parts = [f"host {self.host_memory}"] if self.host_memory is not None else []
        if self.store != "none":
            parts.append(f"{self.store} store {self.store_memory or 'unbounded'}")
        stride = f", windows every {self.window_stride}" if self.window_stride else ""
        stride += f", windows at node ends rounded down to {self.window_align}" if self.window_align else ""
        return " + ".join(parts) + f" ({self.write_policy}{stride})"


class ReplayTiers:
    def __init__(self, kvm: KVManager, config: TierConfig, chunk_tokens: int):
        self.kvm = kvm
        self.config = config
        self.chunk = chunk_tokens
        self.master: MooncakeMaster | None = None
        host = HostTier(config.host_memory, device="meta") if config.host_memory is not None else None
        store: StorageTier | None = None
        if config.store == "sim":
            cap = config.store_memory
            store = DictStore(parse_bytes(cap) if isinstance(cap, str) else cap, name="sim")
        elif config.store == "mooncake":
            address = config.store_master
            if address is None:
                self.master = MooncakeMaster().start()
                address = self.master.address
            segment = config.store_memory or "1GiB"
            store = MooncakeStoreTier(
                address, segment_bytes=parse_bytes(segment) if isinstance(segment, str) else segment
            )
        self.tiers = TierHierarchy(
            kvm.cache,
            host=host,
            store=store,
            policy=config.write_policy,
            host_bandwidth=config.host_bandwidth,
            store_bandwidth=config.store_bandwidth,
            window_stride=config.window_stride,
            window_align=config.window_align,
        )
        self._charged = 0.0

    def plan(self, match: MatchResult, prefix: np.ndarray) -> Fetched:
        """Plan the cross-tier hit of ``prefix`` (its device match ``match``) and start its reads."""
        return self.tiers.fetch(self.tiers.plan(prefix, None, match.length))

    def cancel(self, fetched: Fetched) -> None:
        if fetched.gate is not None:
            fetched.gate.release()

    def restore(self, kv: KVHandle, match: MatchResult, fetched: Fetched) -> tuple[KVHandle, int]:
        """Reserve the request's pages up to the planned end and commit the restore; returns
        the handle (re-admitted on the device hit if the restore fell back) and its hit.
        ``OutOfMemory`` leaves ``kv`` as the caller gave it (the caller releases it)."""
        kvm, plan = self.kvm, fetched.plan
        if not plan.restores:
            return kv, self.tiers.commit(fetched, kv.pages, kv.state_slot)
        try:
            pos = match.length
            while pos < plan.tokens:
                pos = min(plan.tokens, pos + self.chunk)
                kvm.extend(kv, pos)
                kvm.release_windows([kv])
        except OutOfMemory:
            self.cancel(fetched)
            raise
        end = self.tiers.commit(fetched, kv.pages, kv.state_slot)
        if end < plan.tokens:  # an object was missing: recompute from the device hit
            kvm.release(kv)
            return kvm.admit(match), match.length
        if plan.hit.checkpoint not in (None, Where.DEVICE):
            with contextlib.suppress(OutOfMemory):  # no room: the state stays below only
                kvm.checkpoints.take(kv)  # the restored state is the device's again: the next hit is local
        return kv, end

    def record(self, fetched: Fetched, hit: int) -> None:
        """Count a request's hit by component and source tier (once: at its first admission)."""
        self.tiers.record(fetched.plan, hit)

    def wanted_checkpoints(self, kv: KVHandle, fetched: Fetched, prompt_len: int) -> tuple[int, ...]:
        """The placement's checkpoints (``KVManager.checkpoints.wanted``) with the branch point
        where the full KV cached on *any* tier ends, not only the device's."""
        if not self.kvm.has_state:
            return ()
        full = fetched.plan.full_tokens
        return self.kvm.placement.prefill(full if full > kv.seq_len else None, prompt_len, kv.seq_len)

    def take_seconds(self) -> float:
        """Load-back time accrued since the last call (the simulated clock pays it)."""
        total = self.tiers.counters.load_seconds
        out, self._charged = total - self._charged, total
        return out

    def close(self) -> None:
        self.tiers.close()
        if self.master is not None:
            self.master.stop()

    def report(self, input_tokens: int, hit_tokens: int, device_hit_tokens: int) -> dict[str, Any]:
        """Hit rates split by tier per component, bytes moved per tier, load-back time, misses."""
        self.tiers.reap(wait=True)
        c, cfg = self.tiers.counters, self.config
        inputs = max(1, input_tokens)
        split = {
            comp: {t: counts.get(t, 0) / inputs for t in ("device", "host", "store")}
            for comp, counts in c.hit_tokens.items()
        }
        restored = c.restored_tokens
        loaded = {k: int(v) for k, v in c.loaded_bytes.items()}
        tiers: dict[str, Any] = {}
        if self.tiers.host is not None:
            tiers["host"] = {**self.tiers.host.usage(), **self.tiers.host.stats.as_dict()}
        store = self.tiers.store
        if store is not None:
            info: dict[str, Any] = {"name": store.name, **store.stats.as_dict()}
            if isinstance(store, DictStore):
                info |= {"capacity_bytes": store.capacity, "used_bytes": store.used_bytes, "objects": len(store)}
                info["silent_evictions"] = store.silent_evictions
            tiers["store"] = info
        return {
            "config": cfg.describe(),
            "write_policy": cfg.write_policy,
            "bandwidth_bytes_per_s": {"host": cfg.host_bandwidth, "store": cfg.store_bandwidth},
            "hit_rate": hit_tokens / inputs,
            "device_hit_rate": device_hit_tokens / inputs,
            "hit_rate_by_component_and_tier": split,
            "restored_tokens": c.restored_tokens,
            "restored_requests": c.restored_requests,
            "bytes_written": {k: int(v) for k, v in c.written_bytes.items()},
            "objects_written": dict(c.written_objects),
            "write_refused": dict(c.write_refused),
            "write_around": dict(c.write_around),
            "bytes_loaded": loaded,
            "load_seconds": c.load_seconds,
            "load_seconds_per_restored_token": c.load_seconds / restored if restored else 0.0,
            "bytes_loaded_per_restored_token": sum(v for k, v in loaded.items() if k != "device") / restored
            if restored
            else 0.0,
            "misses": dict(Counter(c.misses)),
            "fallbacks": c.fallbacks,
            "tiers": tiers,
        }
