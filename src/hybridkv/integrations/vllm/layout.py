"""The engine-neutral half of the vLLM connector: what each KV cache group is, its keys, the hit rule.

Nothing here imports vLLM (the project's own tests run it without vLLM installed). The connector
(``connector.py``) turns vLLM's ``KVCacheConfig`` into one ``GroupLayout`` per KV cache group and
asks ``BlockIndex`` for the hit.

- ``GroupLayout``: one KV cache group: its kind (full history, sliding window, recurrent state
  checkpointed at block-aligned points, or unsupported: chunked-local or anything else this
  connector cannot restore), block size, window, layer names and vLLM's spec text (heads, head
  size, dtype, ...).
- Keys: ``hkv1/vllm/<model>.<model fingerprint>/pp<r>of<n>/tp<r>of<n>/bs<block>/g<i>-<kind>.<cells>/<name>``
  where ``<name>`` is the 16-hex chain hash of the block's token prefix (hybridkv's page names,
  ``cache/events.py``, rooted in the request's namespace: cache salt and LoRA) and ``<cells>`` a
  digest of the group's layout (kind, block size, window, layer names, spec). A different model,
  dtype, head layout, block size, shard or group never shares a prefix, so never reads these bytes.
- ``BlockIndex``: the scheduler's view of which ``(group, name)`` blocks the worker's host tier
  holds; ``hit_blocks`` is ``tiers.hit.cross_tier_hit`` over it: the longest block-aligned prefix
  at which every full group holds every block, every window group the blocks of its window, and
  every state group the state checkpoint taken after exactly that prefix. A state group's object
  ``(g, name of block i)`` is the recurrent state after the tokens of blocks ``[0, i]`` (vLLM's
  "align" mode keeps a state only at chunk ends, so most blocks have none: the hit ends where one
  was saved). A hit may also end inside a block, at a *tail* (``full_blocks`` and ``holds_tail``):
  vLLM's sub-block hits (``prefix_match_unit`` finer than the block, only with full and state groups),
  where every full group holds the blocks before the tail's block and the tail's block itself (saved
  under the tail's name, its first tokens being the tail's), and every state group the state after
  exactly the tail. The names of the tails inside a block are ``block_names`` of the block's tokens
  with ``unit`` tokens a link, chained from the name of the block before it (a block's own name hashes
  ``block_size`` tokens a link: never the same).

Invariants:
- ``group_prefix`` is a pure function of its arguments (no ``hash()``, no addresses): the
  scheduler and every worker compute the same prefixes.
- ``hit_blocks`` never answers a length a group cannot restore: an unsupported group answers 0, and
  with a state group the answer ends exactly where every state group holds a checkpoint.
- ``holds_tail`` is False with a window group or an unsupported one (vLLM makes no sub-block hits
  with a sliding window) and with no state group (a tail without a state to restore is no hit).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from hybridkv.cache.events import chain_hashes, root_hash
from hybridkv.spec import PoolId
from hybridkv.spec.pools import WindowPool
from hybridkv.tiers.hit import Residency, Where, cross_tier_hit

VERSION = "hkv1"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class GroupKind(StrEnum):
    FULL = "full"
    """Every block of the prefix is needed (full attention, MLA)."""
    WINDOW = "window"
    """Only the blocks of the last ``window`` tokens before the hit's end are needed."""
    STATE = "state"
    """Recurrent state (Mamba / GDN): one checkpoint per block-aligned prefix length, the state after it."""
    UNSUPPORTED = "unsupported"
    """This connector cannot restore the group (chunked-local, state without checkpoints, ...): no hits."""


@dataclass(frozen=True)
class GroupLayout:
    index: int
    kind: GroupKind
    block_size: int
    window: int | None
    layer_names: tuple[str, ...]
    spec_text: str
    """vLLM's spec of the group, as text (heads, head size, dtype, window ...): part of the key."""
    why: str = ""
    """Why an unsupported group is unsupported."""

    def pool(self) -> PoolId | None:
        """The window's hybridkv pool id (its ``first_needed`` is the hit rule), None otherwise."""
        return WindowPool(self.window) if self.kind is GroupKind.WINDOW and self.window else None


def fingerprint(text: str, size: int = 8) -> str:
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def group_prefix(
    model_name: str, model_fp: str, group: GroupLayout, pp: tuple[int, int] = (0, 1), tp: tuple[int, int] = (0, 1)
) -> str:
    """The key prefix of one group's blocks on one shard (ends with ``/``)."""
    cells = fingerprint(repr((group.kind.value, group.block_size, group.window, group.layer_names, group.spec_text)), 6)
    name = _UNSAFE.sub("_", model_name)[-48:].strip("_") or "model"
    return (
        f"{VERSION}/vllm/{name}.{model_fp}/pp{pp[0]}of{pp[1]}/tp{tp[0]}of{tp[1]}/"
        f"bs{group.block_size}/g{group.index}-{group.kind.value}.{cells}/"
    )


def block_key(prefix: str, name: int) -> str:
    return f"{prefix}{name:016x}"


def split_key(key: str) -> tuple[str, int]:
    """``(prefix, name)`` of a ``block_key``."""
    prefix, _, name = key.rpartition("/")
    return prefix + "/", int(name, 16)


def block_names(tokens: Sequence[int], block_size: int, namespace: Hashable, parent: int | None = None) -> list[int]:
    """Chain hashes of the whole blocks of ``tokens`` (continuing after ``parent``, the name of the
    block before ``tokens``, when given)."""
    n = len(tokens) // block_size * block_size
    if n == 0:
        return []
    start = root_hash(namespace) if parent is None else parent
    return chain_hashes(start, np.asarray(tokens[:n], dtype=np.int64), block_size)


@dataclass
class BlockIndex:
    """What the worker's host tier holds, as the scheduler knows it: ``(group, name)`` pairs."""

    groups: list[GroupLayout]
    held: set[tuple[int, int]] = field(default_factory=set)

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def supported(self) -> str:
        """Why some group cannot be restored ("" when every group can)."""
        if not self.groups:
            return "no KV cache groups"
        bad = [g for g in self.groups if g.kind is GroupKind.UNSUPPORTED]
        if bad:
            return "; ".join(f"group {g.index}: {g.why}" for g in bad)
        sizes = {g.block_size for g in self.groups}
        if len(sizes) > 1:
            return f"groups with different block sizes {sorted(sizes)}"
        return ""

    def add(self, pairs: Iterable[tuple[int, int]]) -> None:
        self.held.update(pairs)

    def discard(self, pairs: Iterable[tuple[int, int]]) -> None:
        self.held.difference_update(pairs)

    def residency(self, names: Sequence[int]) -> Residency:
        n = len(names)
        held = self.held
        full = np.full(n, Where.HOST, dtype=np.int8)
        windows = []
        checkpoints: np.ndarray | None = None
        for g in self.groups:
            mask = np.fromiter(((g.index, h) in held for h in names), dtype=bool, count=n)
            where = np.where(mask, Where.HOST, Where.NOWHERE).astype(np.int8)
            if g.kind is GroupKind.FULL:
                full = np.maximum(full, where)
            elif g.kind is GroupKind.WINDOW:
                windows.append(where)
            else:  # STATE: block i's object is the state after i + 1 blocks
                after = np.concatenate([np.array([Where.NOWHERE], dtype=np.int8), where])
                checkpoints = after if checkpoints is None else np.maximum(checkpoints, after)
        return Residency(full, tuple(windows), checkpoints)

    def full_blocks(self, names: Sequence[int]) -> int:
        """How many leading blocks of ``names`` every full group holds."""
        full = [g.index for g in self.groups if g.kind is GroupKind.FULL]
        held = self.held
        for i, h in enumerate(names):
            if any((g, h) not in held for g in full):
                return i
        return len(names)

    def holds_tail(self, name: int) -> bool:
        """Whether every full group holds the tail ``name``'s block and every state group the state after it
        (the blocks before it are ``full_blocks``' business)."""
        kinds = {g.kind for g in self.groups}
        if self.supported or GroupKind.STATE not in kinds or kinds - {GroupKind.FULL, GroupKind.STATE}:
            return False
        return all((g.index, name) in self.held for g in self.groups)

    def hit_blocks(self, names: Sequence[int]) -> int:
        """The longest prefix of ``names`` (blocks) restorable for every group; 0 if a group cannot be."""
        if self.supported or not names:
            return 0
        pools = [g.pool() for g in self.groups if g.kind is GroupKind.WINDOW]
        hit = cross_tier_hit(self.residency(names), self.block_size, [p for p in pools if p is not None])
        return hit.pages
