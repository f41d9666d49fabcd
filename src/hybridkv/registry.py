"""``Registry[T]``: the named variants of one kind, each added in one place.

Every registry of the package is one: transports (``transfer.transport.TRANSPORTS``),
eviction policies (``cache.policies.POLICIES``), checkpoint placements
(``cache.placement.PLACEMENTS``), Hugging Face architectures (``spec.hf_config``), layer
kinds of a preset record (``spec.presets``), dtypes (``spec.layers``), the engine's model
classes (``engine.registry``) and its tiny random models (``engine.random_models``), the
built-in traces (``traces.TRACES``). A registry is a read-only ``Mapping`` from a name to a
value; a lookup of a name it does not know raises ``UnknownName``, whose message names the
kind and every known name (it is a ``KeyError``, so ``get`` and ``in`` work as for a dict,
and a ``ValueError``, what a bad name from a user is).

Invariants: a name is added once (a second ``add`` is refused, nothing changed); lookups
change nothing; iteration follows the order of ``add``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name a registry does not know; the message names the kind and the known names."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry(Mapping[str, T]):
    def __init__(self, kind: str, entries: Mapping[str, T] | Iterable[tuple[str, T]] = ()):
        """``kind``: what one entry is, for messages ("transport", "eviction policy", ...)."""
        self.kind = kind
        self._entries: dict[str, T] = {}
        for name, value in entries.items() if isinstance(entries, Mapping) else entries:
            self.add(name, value)

    def add(self, name: str, value: T) -> T:
        """Register ``value`` as ``name``; returns it. A name already taken is refused."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} is registered under a non-empty string name, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._entries[name] = value
        return value

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            raise UnknownName(f"unknown {self.kind} {name!r}; known: {', '.join(self._entries)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"
