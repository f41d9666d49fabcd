"""Residency events a router can follow: which pages (and checkpoints) the cache stores or drops.

Pages are named by chained block hashes, like other engines' KV events: the name of page
``i`` is ``blake2b(name of page i-1 || its token bytes)`` (8 bytes, little-endian), starting
from a per-namespace root name, so two trees (or a tree and a router) that saw the same
tokens agree on every name, in any process: the hash is not Python's ``hash()``, which is
salted per process (``PYTHONHASHSEED``). Splitting a node renames nothing. Each event
carries one component: its pool id (as the memory names it) and its ``ComponentKind``.

Namespaces that events name must be ``None``, ``str``, ``bytes``, ``int`` or tuples of
those: anything else has no encoding that is the same in every process.

Invariants:
- Events are emitted only after the change they describe has happened, in order.
- For every component, following the events from an empty cache gives exactly the set of
  resident pages (and state checkpoints) the tree holds; ``tests/cache`` replays them into
  an oracle to prove it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from hybridkv.cache.errors import CacheError
from hybridkv.cache.rules import ComponentKind

_DIGEST = 8


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class CacheEvent:
    kind: EventKind
    component: str
    """The pool's display name (``str(pool_id)``), so that routers and JSON read plain strings."""
    component_kind: ComponentKind
    namespace: Hashable
    block_hashes: tuple[int, ...]
    parent_hash: int | None = None
    """For stored full-KV pages: the hash of the page before the first one."""
    tokens: tuple[int, ...] | None = None
    """For stored full-KV pages: their token ids, page after page."""


def _encode(value: object) -> bytes:
    """A process-independent encoding of a namespace (type-tagged, length-prefixed)."""
    if value is None:
        return b"n"
    if isinstance(value, bool):
        return b"?" + (b"1" if value else b"0")
    if isinstance(value, int):
        text = str(value).encode()
        return b"i" + len(text).to_bytes(4, "little") + text
    if isinstance(value, str):
        data = value.encode()
        return b"s" + len(data).to_bytes(4, "little") + data
    if isinstance(value, bytes):
        return b"b" + len(value).to_bytes(4, "little") + value
    if isinstance(value, tuple):
        return b"t" + len(value).to_bytes(4, "little") + b"".join(_encode(v) for v in value)
    raise CacheError(
        f"extra_key {value!r} ({type(value).__name__}) has no stable name for cache events; "
        "use None, str, bytes, int or a tuple of those"
    )


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=_DIGEST).digest(), "little")


def root_hash(namespace: Hashable) -> int:
    return _digest(b"hybridkv-root:" + _encode(namespace))


def chain_hashes(parent_hash: int, key: np.ndarray, page_size: int) -> list[int]:
    """Chained hashes of the pages of ``key`` (int64 tokens, a whole number of pages): page
    ``i`` is ``_digest(name of page i-1 || its tokens)``, chained on the digest bytes."""
    out = []
    prev = parent_hash.to_bytes(_DIGEST, "little")
    data = np.ascontiguousarray(key, dtype="<i8").tobytes()
    step = page_size * 8
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    for off in range(0, len(data), step):
        prev = blake2b(prev + data[off : off + step], digest_size=_DIGEST).digest()
        out.append(from_bytes(prev, "little"))
    return out


class EventLog:
    """Buffers events when enabled; ``drain()`` hands them over and empties the buffer."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self._events: list[CacheEvent] = []

    def emit(self, event: CacheEvent) -> None:
        self._events.append(event)

    def drain(self) -> list[CacheEvent]:
        out, self._events = self._events, []
        return out

    def __len__(self) -> int:
        return len(self._events)
