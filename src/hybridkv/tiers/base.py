"""The storage-tier interface: put / get / exists / evict of framed objects, batched, asynchronous.

Every operation takes a batch of keys and returns a ``Ticket`` at once: ``poll()`` says
whether it is done, ``wait(timeout_s)`` returns its result or raises ``TierTimeout``
(after which the tier counts itself down until it answers again). A tier whose backend is
local memory completes a batch inside ``submit_*`` (its ticket is done when returned); a
networked one (the Mooncake Store) runs batches in order on its own worker thread.

Results are per object: a put is ``PutStatus``; a get is the verified payload (a view of
the frame: ``framing.check`` passed) or a ``MissReason`` (never unverified bytes); exists is
a bool mask; evict the number of objects removed. Tiers keep counters (``TierStats``).

Invariants:
- ``get`` never returns a payload whose size, header or checksum disagrees: the backend's
  raw frame goes through ``framing.check`` here, in one place for every backend.
- A tier that is down answers every operation at once (``DOWN`` / all-False / 0): no
  caller waits on an unreachable service longer than its own ``wait`` timeout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

import numpy as np
import torch

from hybridkv.tiers.framing import HEADER, MissReason, check

T = TypeVar("T")

Payload = torch.Tensor
"""A verified object payload: a 1-D uint8 view (a meta tensor in a replay: a size, no bytes)."""


class TierError(RuntimeError):
    """A tier misused or misconfigured (bad arguments, a backend that cannot start)."""


class TierTimeout(TierError):
    """A ticket did not complete within the caller's timeout."""


class PutStatus(StrEnum):
    STORED = "stored"
    KEPT = "kept"
    """The tier holds the key already (content-addressed: the same bytes); nothing written."""
    REFUSED = "refused"
    """No room (bigger than the tier, or a full store: NO_AVAILABLE_HANDLE)."""
    DOWN = "down"
    ERROR = "error"


class Ticket(Generic[T]):
    """One batched operation in flight."""

    __slots__ = ("_future", "_on_timeout")

    def __init__(self, future: Future[T], on_timeout: Callable[[], None] | None = None):
        self._future = future
        self._on_timeout = on_timeout

    @classmethod
    def done(cls, value: T) -> Ticket[T]:
        future: Future[T] = Future()
        future.set_result(value)
        return cls(future)

    def poll(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float) -> T:
        try:
            return self._future.result(timeout=timeout_s)
        except FutureTimeout:
            if self._on_timeout is not None:
                self._on_timeout()
            raise TierTimeout(f"a tier operation did not finish within {timeout_s} s") from None


@dataclass
class TierStats:
    puts: int = 0
    put_bytes: int = 0
    kept: int = 0
    refused: int = 0
    put_errors: int = 0
    gets: int = 0
    get_bytes: int = 0
    misses: Counter[str] = field(default_factory=Counter)
    """Misses of ``get`` by ``MissReason`` value."""
    removed: int = 0
    down_events: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "puts": self.puts,
            "put_bytes": self.put_bytes,
            "kept": self.kept,
            "refused": self.refused,
            "put_errors": self.put_errors,
            "gets": self.gets,
            "get_bytes": self.get_bytes,
            "misses": dict(self.misses),
            "removed": self.removed,
            "down_events": self.down_events,
        }


class StorageTier(ABC):
    """A store of framed objects (``framing.py``) under string keys."""

    name: str = "tier"
    timeout_s: float = 30.0
    """What the synchronous helpers (``put``/``get``/...) wait for a ticket."""

    def __init__(self) -> None:
        self.stats = TierStats()

    # --- what a backend provides ----------------------------------------------------------

    @abstractmethod
    def _write(self, keys: list[str], frames: list[torch.Tensor], label: str) -> list[PutStatus]:
        """Store ``frames[i]`` under ``keys[i]``; ``label`` names the component (stats)."""

    @abstractmethod
    def _read(self, keys: list[str], frame_bytes: list[int]) -> list[torch.Tensor | MissReason]:
        """The raw frames of ``keys`` (``frame_bytes[i]`` expected), or why not."""

    @abstractmethod
    def _exists(self, keys: list[str]) -> np.ndarray:
        """Bool mask: which keys the tier holds now."""

    @abstractmethod
    def _remove(self, keys: list[str]) -> int:
        """Remove ``keys``; how many it held."""

    def _run(self, call: Callable[[], T], down: Callable[[], T]) -> Ticket[T]:
        """Run one batch: here, at once (local tiers). ``down`` is the answer of a tier that
        is down (a networked tier overrides this)."""
        return Ticket.done(call())

    @property
    def up(self) -> bool:
        return True

    def close(self) -> None:  # noqa: B027  (a tier with nothing to close keeps this)
        """Release the backend (idempotent)."""

    # --- the interface --------------------------------------------------------------------

    def submit_put(
        self, keys: Sequence[str], frames: Sequence[torch.Tensor], label: str = ""
    ) -> Ticket[list[PutStatus]]:
        ks, fs = _batch(keys, "put"), list(frames)
        if len(fs) != len(ks):
            raise TierError(f"{self.name} put: {len(ks)} keys but {len(fs)} frames")
        uint8 = torch.uint8
        for f in {id(f): f for f in fs}.values():  # each distinct frame once (a replay shares one per size)
            if type(f) is not torch.Tensor or f.dtype != uint8 or f.dim() != 1:
                raise TierError(f"{self.name} put: frames must be 1-D uint8 tensors (framing.frame), got {f!r:.80}")
        return self._run(lambda: self._do_put(ks, fs, label), lambda: [PutStatus.DOWN] * len(ks))

    def submit_get(self, keys: Sequence[str], payload_bytes: Sequence[int]) -> Ticket[list[Payload | MissReason]]:
        """Payloads of ``keys``, each verified against ``payload_bytes[i]`` (its expected size)."""
        ks, sizes = _batch(keys, "get"), [int(n) for n in payload_bytes]
        if len(sizes) != len(ks):
            raise TierError(f"{self.name} get: {len(ks)} keys but {len(sizes)} sizes")
        return self._run(lambda: self._do_get(ks, sizes), lambda: self._missed(len(ks), MissReason.DOWN))

    def submit_exists(self, keys: Sequence[str]) -> Ticket[np.ndarray]:
        ks = _batch(keys, "exists")
        return self._run(lambda: self._exists(ks), lambda: np.zeros(len(ks), dtype=bool))

    def submit_evict(self, keys: Sequence[str]) -> Ticket[int]:
        ks = _batch(keys, "evict")
        return self._run(lambda: self._do_remove(ks), lambda: 0)

    def put(self, keys: Sequence[str], frames: Sequence[torch.Tensor], label: str = "") -> list[PutStatus]:
        return self.submit_put(keys, frames, label).wait(self.timeout_s)

    def get(self, keys: Sequence[str], payload_bytes: Sequence[int]) -> list[Payload | MissReason]:
        return self.submit_get(keys, payload_bytes).wait(self.timeout_s)

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        return self.submit_exists(keys).wait(self.timeout_s)

    def evict(self, keys: Sequence[str]) -> int:
        return self.submit_evict(keys).wait(self.timeout_s)

    # --- bookkeeping ----------------------------------------------------------------------

    def _do_put(self, keys: list[str], frames: list[torch.Tensor], label: str) -> list[PutStatus]:
        out = self._write(keys, frames, label) if keys else []
        st, counts = self.stats, Counter(out)
        st.puts += counts.pop(PutStatus.STORED, 0)
        st.kept += counts.pop(PutStatus.KEPT, 0)
        st.refused += counts.pop(PutStatus.REFUSED, 0)
        st.put_errors += sum(counts.values())
        st.put_bytes += sum(f.numel() for f, s in zip(frames, out, strict=True) if s is PutStatus.STORED)
        return out

    def _do_get(self, keys: list[str], sizes: list[int]) -> list[Payload | MissReason]:
        raw = self._read(keys, [HEADER + n for n in sizes]) if keys else []
        out: list[Payload | MissReason] = []
        st = self.stats
        for key, n, blob in zip(keys, sizes, raw, strict=True):
            got = blob if isinstance(blob, MissReason) else check(key, n, blob)
            if isinstance(got, MissReason):
                st.misses[got.value] += 1
            else:
                st.gets += 1
                st.get_bytes += HEADER + n
            out.append(got)
        return out

    def _do_remove(self, keys: list[str]) -> int:
        n = self._remove(keys) if keys else 0
        self.stats.removed += n
        return n

    def _missed(self, n: int, reason: MissReason) -> list[Payload | MissReason]:
        self.stats.misses[reason.value] += n
        return [reason] * n


def _batch(keys: Sequence[str], what: str) -> list[str]:
    ks = list(keys)
    if "" in ks or not all(type(k) is str for k in ks):
        bad = next(k for k in ks if type(k) is not str or not k)
        raise TierError(f"{what}: keys must be non-empty strings (keys.KeySpace), got {bad!r}")
    return ks
