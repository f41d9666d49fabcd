"""The vLLM connector worker's tiers: a host tier over an optional store, and what they hold, as one report.

Nothing here imports vLLM (the project's own tests run it without vLLM installed). The worker half
of ``HybridKVConnector`` (``connector.py``) saves, loads and evicts objects through ``WorkerTiers``
and, once per step, sends the scheduler ``take_report()``: the ``(group, block name)`` pairs that
became held and those that stopped being held since the last report. The scheduler's
``layout.BlockIndex`` applies it as ``discard(dropped)`` then ``add(stored)``.

- ``put``: into the host tier, whose LRU evictions go to the store below (``on_evict``) and are
  dropped only where there is no store or it refuses them.
- ``get``: from the host tier, and what it does not hold (absent) from the store; a block read from
  the store is *promoted*: ``promote()`` (called once the caller has copied the payloads out: a put
  may evict the host's buffers) puts it back into the host tier as its most recently used object,
  within the host's budget (what that evicts goes down to the store like any eviction).
- ``evict``: out of both tiers.

Invariants:
- One verdict per pair and report: a pair is in ``stored`` or in ``dropped``, never both, and the
  verdict is the last thing that happened to it (a block stored and evicted by the same batch, or
  by a later batch of the same step, is dropped). After the scheduler applies every report, its
  index is exactly the pairs the host tier holds or the store was given (the store's own silent
  evictions aside: those are counted load misses, never stale bytes).
- A promotion never changes what is held (the store keeps its copy); it only moves the object up.
- ``host.used_bytes <= host.budget`` always (the host tier's own invariant), promotions included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from hybridkv.tiers import HostTier, MissReason, PutStatus, StorageTier
from hybridkv.tiers.base import Payload
from hybridkv.tiers.framing import frame

Pair = tuple[int, int]
"""(KV cache group index, block name)."""

_HELD = (PutStatus.STORED, PutStatus.KEPT)


class WorkerTiers:
    def __init__(self, host_bytes: int | str, store: StorageTier | None, pair_of: Callable[[str], Pair | None]):
        """``pair_of`` names the ``(group, block name)`` of a key (None: not one of this worker's)."""
        self.store = store
        self.host = HostTier(host_bytes, on_evict=self._on_evict)
        self.pair_of = pair_of
        self.stats: Counter[str] = Counter()
        """``evicted`` (host LRU evictions), ``written_back`` (of those, held by the store),
        ``store_loaded_blocks`` (loads the store answered), ``promoted`` (of those, put back into the host tier)."""
        self._held: dict[Pair, bool] = {}
        """The last verdict on each pair since the last report."""
        self._promotions: list[tuple[str, Payload, str]] = []

    def put(self, pairs: Sequence[Pair], keys: Sequence[str], frames: Sequence[torch.Tensor], label: str) -> int:
        """Store ``frames`` under ``keys`` (the blocks ``pairs``), in this order (the last ends most recently
        used); how many were new."""
        # held first: a block this very put evicts again is told dropped by ``_on_evict``, after this
        self._held.update(dict.fromkeys(pairs, True))
        status = self.host.put(keys, frames, label=label)
        self.drop([pair for pair, st in zip(pairs, status, strict=True) if st not in _HELD])
        return sum(st is PutStatus.STORED for st in status)

    def drop(self, pairs: Sequence[Pair]) -> None:
        """Report ``pairs`` not held (a failed load, removed; a block whose save was skipped)."""
        self._held.update(dict.fromkeys(pairs, False))

    def _on_evict(self, keys: list[str], frames: list[torch.Tensor], labels: list[str]) -> None:
        """The host's LRU evictions: written back to the store (still held), or dropped without one or where
        it refuses them."""
        self.stats["evicted"] += len(keys)
        kept = [PutStatus.DOWN] * len(keys)
        if self.store is not None:
            kept = self.store.put(keys, frames, label="written back")
            self.stats["written_back"] += sum(st in _HELD for st in kept)
        gone = [self.pair_of(k) for k, st in zip(keys, kept, strict=True) if st not in _HELD]
        self.drop([p for p in gone if p is not None])

    def get(self, keys: Sequence[str], payload_bytes: int, label: str) -> list[Payload | MissReason]:
        """Verified payloads from the host tier, else from the store (to be promoted: ``promote``)."""
        got = self.host.get(keys, [payload_bytes] * len(keys))
        below = [i for i, p in enumerate(got) if p is MissReason.ABSENT]
        if self.store is not None and below:
            for i, p in zip(below, self.store.get([keys[i] for i in below], [payload_bytes] * len(below)), strict=True):
                got[i] = p
                if not isinstance(p, MissReason):
                    self.stats["store_loaded_blocks"] += 1
                    self._promotions.append((keys[i], p, label))
        return got

    def promote(self) -> None:
        """Put the blocks read from the store since the last call back into the host tier, as its most recently
        used objects (what that evicts goes to the store, or is dropped, as any eviction). Their verdict stays
        as it is: held by the store, they are held whatever the host does with them."""
        todo, self._promotions = self._promotions, []
        by_label: dict[str, list[tuple[str, Payload]]] = {}
        for key, payload, label in todo:
            by_label.setdefault(label, []).append((key, payload))
        for label, items in by_label.items():
            status = self.host.put([k for k, _ in items], [frame(k, p) for k, p in items], label=label)
            self.stats["promoted"] += sum(st is PutStatus.STORED for st in status)

    def evict(self, keys: Sequence[str]) -> int:
        """``keys`` out of the host tier and the store: how many the host held (report them with ``drop``)."""
        if self.store is not None:
            self.store.evict(keys)
        return self.host.evict(keys)

    def touch(self, keys: Sequence[str]) -> None:
        self.host.touch(list(keys))

    def take_report(self) -> tuple[list[Pair], list[Pair]]:
        """``(stored, dropped)`` since the last report: one verdict per pair, the last one."""
        held, self._held = self._held, {}
        return [p for p, h in held.items() if h], [p for p, h in held.items() if not h]
