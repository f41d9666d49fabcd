"""Brute-force oracle: a store of token tuples with per-component validity.

Each cached page is keyed by ``(namespace, the token tuple up to its end)``; the store says
whether its full KV is cached, whether each window pool holds it, and whether a state
checkpoint sits at its end. ``longest_valid`` tries every page-aligned length, longest
first, and checks every rule from scratch, so it shares no code or shortcut with the tree.

Two ways to fill it:
- ``record_insert``: from what a test inserted (which pages it held in each window pool,
  where it had checkpoints). Without eviction the tree must answer exactly this; with
  eviction never more.
- ``apply``: from the cache's events, which must then describe the tree exactly.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from hybridkv.cache import CacheEvent, ComponentKind, EventKind
from hybridkv.cache.events import root_hash

Key = tuple[Hashable, tuple[int, ...]]


class Oracle:
    def __init__(self, page_size: int, windows: dict[str, int], history: tuple[str, ...], state: str | None):
        self.page_size = page_size
        self.windows = windows
        self.history = history
        self.state = state
        self.full: set[Key] = set()
        self.window: dict[str, set[Key]] = {name: set() for name in windows}
        self.states: set[Key] = set()
        self._prefix: dict[int, Key] = {}

    # --- filling ------------------------------------------------------------------------------

    def record_insert(
        self,
        namespace: Hashable,
        tokens: tuple[int, ...],
        window_resident: dict[str, list[bool]],
        state_positions: Iterable[int],
    ) -> None:
        ps = self.page_size
        for i in range(len(tokens) // ps):
            key = (namespace, tokens[: (i + 1) * ps])
            self.full.add(key)
            for name, resident in window_resident.items():
                if resident[i]:
                    self.window[name].add(key)
        for pos in state_positions:
            self.states.add((namespace, tokens[:pos]))

    def apply(self, events: Iterable[CacheEvent]) -> None:
        ps = self.page_size
        for ev in events:
            if ev.component_kind is ComponentKind.FULL_KV:
                assert ev.component in self.history
                if ev.kind is EventKind.STORED:
                    assert ev.tokens is not None and ev.parent_hash is not None
                    if ev.parent_hash == root_hash(ev.namespace):
                        base: Key = (ev.namespace, ())
                    else:
                        base = self._prefix[ev.parent_hash]
                    for i, h in enumerate(ev.block_hashes):
                        key = (ev.namespace, base[1] + ev.tokens[: (i + 1) * ps])
                        assert key not in self.full, f"stored twice: {len(key[1])} tokens"
                        self._prefix[h] = key
                        self.full.add(key)
                else:
                    for h in ev.block_hashes:
                        self.full.remove(self._prefix[h])
                continue
            keys = [self._prefix[h] for h in ev.block_hashes]
            if ev.component_kind is ComponentKind.CHECKPOINT:
                assert ev.component == self.state
                target = self.states
            else:
                assert ev.component_kind is ComponentKind.WINDOW
                target = self.window[ev.component]
            for key in keys:
                if ev.kind is EventKind.STORED:
                    assert key not in target, f"{ev.component} stored twice"
                    target.add(key)
                else:
                    target.remove(key)

    # --- answers ------------------------------------------------------------------------------

    def valid(self, namespace: Hashable, tokens: tuple[int, ...], end: int) -> bool:
        ps = self.page_size
        if end == 0:
            return True
        if any((namespace, tokens[:e]) not in self.full for e in range(ps, end + 1, ps)):
            return False
        for name, w in self.windows.items():
            first_page = max(0, end - w) // ps
            for p in range(first_page, end // ps):
                if (namespace, tokens[: (p + 1) * ps]) not in self.window[name]:
                    return False
        return self.state is None or (namespace, tokens[:end]) in self.states

    def longest_valid(self, namespace: Hashable, tokens: tuple[int, ...]) -> int:
        ps = self.page_size
        for end in range(len(tokens) - len(tokens) % ps, -1, -ps):
            if self.valid(namespace, tokens, end):
                return end
        return 0

    def longest_full(self, namespace: Hashable, tokens: tuple[int, ...]) -> int:
        ps = self.page_size
        end = 0
        while end + ps <= len(tokens) and (namespace, tokens[: end + ps]) in self.full:
            end += ps
        return end
