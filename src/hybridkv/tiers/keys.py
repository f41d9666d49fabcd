"""Object keys below the device: what a stored page or state checkpoint is, named by content.

A key is ``<layout prefix><chain hash>``. The chain hash is the prefix cache's page name
(``cache/events.py``: ``blake2b`` over the previous name and the page's tokens, rooted in the
request's namespace), so every process that saw the same tokens under the same namespace
names the same page the same way; a state checkpoint after ``e`` pages is named by the hash
of page ``e - 1``. The layout prefix says what the bytes *mean*: the model spec's
fingerprint, this shard's layer range, its PP stage and TP rank out of their sizes, the
page size and the pool (whose cell layout, every segment's layer, tensor, dtype, shape and
offset, is part of the fingerprint). Two shards whose layouts differ in anything never
share a prefix, so they never read each other's bytes.

Invariants:
- A prefix is a pure function of (spec, parallel layout, shard, page size, pool cell
  layout): the same in every process (no ``hash()``, no addresses).
- Keys hold only ``[A-Za-z0-9._:/-]`` (a store key, a file name, a log line).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from hybridkv.cache.events import chain_hashes, root_hash
from hybridkv.memory import UnifiedMemory
from hybridkv.memory.layout import CellLayout
from hybridkv.spec import PoolId, ShardSpec

VERSION = "hkv1"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def spec_fingerprint(shard: ShardSpec) -> str:
    """A digest of the model spec and parallel layout (name, dtype, every layer's kind)."""
    model = shard.model
    text = repr((model.name, str(model.kv_dtype), model.layers, shard.parallel))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def layout_prefix(shard: ShardSpec, page_size: int, layout: CellLayout) -> str:
    """The key prefix of one pool's objects on one shard (ends with ``/``)."""
    start, end = shard.bounds
    par = shard.parallel
    cells = hashlib.blake2b(repr(layout).encode(), digest_size=6).hexdigest()
    name = _UNSAFE.sub("_", shard.model.name)[:48]
    return (
        f"{VERSION}/{name}.{spec_fingerprint(shard)}/L{start}-{end}/pp{shard.pp_rank}of{par.pp_size}/"
        f"tp{shard.tp_rank}of{par.tp_size}/ps{page_size}/{_UNSAFE.sub('_', str(layout.pool_id))}.{cells}/"
    )


@dataclass(frozen=True)
class KeySpace:
    """The key prefixes of one memory's pools (one shard), and names of a request's pages."""

    page_size: int
    prefixes: dict[PoolId, str]
    payload_bytes: dict[PoolId, int]
    """Bytes of one object of each pool: one page's cell (a page pool) or one slot's (state)."""

    @classmethod
    def of(cls, mem: UnifiedMemory) -> KeySpace:
        ps = mem.page_size
        return cls(
            ps,
            {p: layout_prefix(mem.shard, ps, mem.layout(p)) for p in mem.pools},
            {p: pool.cell_bytes for p, pool in mem.pools.items()},
        )

    def key(self, pool: PoolId, name: int) -> str:
        return f"{self.prefixes[pool]}{name:016x}"

    def keys(self, pool: PoolId, names: list[int]) -> list[str]:
        pattern = self.prefixes[pool] + "%016x"  # prefixes hold no '%' (_UNSAFE)
        return [pattern % h for h in names]

    def page_names(self, tokens: np.ndarray, namespace: Hashable = None) -> list[int]:
        """Chained names of the whole pages of ``tokens`` under ``namespace`` (what the cache
        names them when it stores them)."""
        n = tokens.size // self.page_size * self.page_size
        return chain_hashes(root_hash(namespace), tokens[:n], self.page_size)
