"""Pool ids: which sub-pool a layer's memory lives in, and the history rule of that pool.

A ``PoolId`` is a typed, hashable value, one frozen dataclass per pool *family*. Every
lookup (memory pools, layouts, eviction keys, transfer regions) uses the value;
``str(pool_id)`` (``"full"``, ``"mla"``, ``"swa:1024"``, ``"state"``) is for display and
JSON only, and ``PoolId.parse`` reads it back.

Each pool id owns its *history rule*, ``first_needed(L)``, one statement read by every
package: for ``L >= 1``, the first position the token at ``L - 1`` reads in that pool, which
is also the first position a continuation at sequence length ``L`` needs resident there
(memory, the prefix cache and transfer keep ``[first_needed(L), L)``; the engine's attention
lets the query at ``q`` see the keys ``first_needed(q + 1) <= k <= q``):

- full attention and MLA: ``[0, L)``;
- sliding window ``W``: ``[max(0, L - W), L)``;
- recurrent state: no tokens (``first_needed(L) == L``), but a state at exactly ``L``
  (``needs_state``).

Memory (window release, sizing), the prefix cache (hit validity per component) and transfer
(the span to send) all derive what they do from ``first_needed`` / ``max_span`` /
``needs_state``, never from the family.

Invariants:
- Layers share a pool exactly when their kinds give equal pool ids, so one rule holds for
  every layer of a pool.
- ``0 <= first_needed(L) <= L``, non-decreasing in ``L``; ``L - first_needed(L) <=
  max_span`` for every ``L`` (``max_span is None``: unbounded).
- A token pool (``IdSpace.PAGE``) has ``first_needed(L) <= L - 1`` for ``L >= 1``: the token
  at ``L - 1`` reads itself. (A rule that reads "what the token at ``L`` reads", e.g. a chunk
  rule ``L // C * C``, breaks it at ``L = C`` and would leave the engine's query at ``C - 1``
  no key.) ``check_rule`` proves these on a range of lengths; ``ModelSpec`` calls it for each
  of its pool ids, so a pool id that breaks one is refused when the spec is built.
- A family name belongs to one class (one module and qualified name): a subclass registers it
  when it is created, and a second class with a taken family is refused then, whatever its
  name (a test's ``ChunkPool`` never replaces a product ``ChunkPool``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, TypeVar

import numpy as np

Positions = TypeVar("Positions", int, np.ndarray)
"""A sequence length / position, or an int64 array of them (the rules are elementwise)."""


CHECKED_LENGTHS = 1 << 14
"""Lengths ``check_rule`` covers when a spec is built, at most: every rule here repeats within its
``max_span`` (windows up to 1024 in the presets, Llama 4's 8192-token chunks) or is one expression
for every length (0, ``L``); 16 Ki lengths take ~0.15 ms a pool id (measured)."""


class IdSpace(Enum):
    """The virtual id space a pool's cells are addressed by."""

    PAGE = "page"
    """Virtual page ids, shared by every token pool: a cell holds ``page_size`` tokens."""
    SLOT = "state slot"
    """Virtual state-slot ids: a cell holds one request's state (or a cached checkpoint)."""


class PoolIdError(ValueError):
    """A pool id that cannot be read or registered."""


@dataclass(frozen=True)
class PoolId:
    """Base of every pool family. Subclasses set the class variables and the rule."""

    family: ClassVar[str]
    id_space: ClassVar[IdSpace]
    rank: ClassVar[int]
    """Order of the family among a shard's pools (pools grow from alternate arena ends)."""
    needs_state: ClassVar[bool] = False
    """True: a continuation at ``L`` needs a state taken at exactly ``L`` (no tokens)."""
    _families: ClassVar[dict[str, type[PoolId]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        family = cls.__dict__.get("family")
        if family is None:
            return
        other = PoolId._families.get(family)
        if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
            raise PoolIdError(
                f"pool family {family!r} is taken by {other.__qualname__} ({other.__module__}); "
                f"{cls.__qualname__} ({cls.__module__}) must pick another family name (a kind a test defines: "
                f"a family of its own, e.g. 'test-{family}')"
            )
        PoolId._families[family] = cls  # the same class created again (its module reloaded) replaces itself

    @property
    def param(self) -> int | None:
        """The family's parameter (a window, a chunk size), if it has one."""
        return None

    def __str__(self) -> str:
        return self.family if self.param is None else f"{self.family}:{self.param}"

    @classmethod
    def from_param(cls, param: int | None) -> PoolId:
        if param is not None:
            raise PoolIdError(f"pool family {cls.family!r} takes no parameter, got {param}")
        return cls()

    @staticmethod
    def parse(text: str) -> PoolId:
        """The pool id that ``str()`` displayed as ``text`` (``"swa:1024"`` -> ``WindowPool(1024)``)."""
        family, sep, raw = text.partition(":")
        cls = PoolId._families.get(family)
        if cls is None:
            raise PoolIdError(f"unknown pool family {family!r} in {text!r}; known: {sorted(PoolId._families)}")
        try:
            param = int(raw) if sep else None
        except ValueError:
            raise PoolIdError(f"pool id {text!r}: parameter {raw!r} is not an integer") from None
        return cls.from_param(param)

    def sort_key(self) -> tuple[int, int]:
        return self.rank, self.param or 0

    # --- the history rule ---------------------------------------------------------------

    def first_needed(self, seq_len: Positions) -> Positions:
        """For ``seq_len >= 1``: the first position the token at ``seq_len - 1`` reads here, which is
        the first a continuation at ``seq_len`` needs resident (0 for ``seq_len == 0``)."""
        raise NotImplementedError(f"{type(self).__qualname__} must define first_needed")

    def check_rule(self, upto: int) -> None:
        """Raise ``PoolIdError`` naming the broken invariant (module docstring) and the first length
        that breaks it, for the lengths ``0 .. upto``."""
        lens = np.arange(upto + 1, dtype=np.int64)
        first = np.asarray(self.first_needed(lens))
        top = lens - 1 if self.id_space is IdSpace.PAGE else lens
        top[0] = 0
        span = self.max_span
        broken = [
            ("0 <= first_needed(L)", first < 0),
            (
                "first_needed(L) <= L - 1 for L >= 1 (the token at L - 1 reads itself)"
                if self.id_space is IdSpace.PAGE
                else "first_needed(L) <= L",
                first > top,
            ),
            ("first_needed(L) non-decreasing in L", np.diff(first, prepend=0) < 0),
            (f"L - first_needed(L) <= max_span ({span})", lens - first > (upto if span is None else span)),
        ]
        for rule, bad in broken:
            if bad.any():
                at = int(np.argmax(bad))
                raise PoolIdError(
                    f"pool id {self} ({type(self).__qualname__}) breaks the history rule {rule}: "
                    f"first_needed({at}) is {int(first[at])}; make first_needed(L) the first position "
                    f"the token at L - 1 reads (and max_span the most tokens that leaves behind it)"
                )

    @property
    def max_span(self) -> int | None:
        """Most tokens a continuation ever needs resident here; None: every token."""
        raise NotImplementedError(f"{type(self).__qualname__} must define max_span")

    def span(self, seq_len: int) -> tuple[int, int]:
        """Token positions ``[start, end)`` a continuation at ``seq_len`` needs resident."""
        return self.first_needed(seq_len), seq_len

    def page_span(self, seq_len: int, page_size: int) -> tuple[int, int]:
        """Row pages ``[first, end)`` a token pool keeps for a continuation at ``seq_len``
        (row page ``k`` holds positions ``[k * page_size, (k + 1) * page_size)``): the pages
        of the needed tokens, and a partly filled last page, which the next token writes.
        Pages before ``first`` may leave the pool (and be sent by no transfer)."""
        return self.first_needed(seq_len) // page_size, -(-seq_len // page_size)

    @property
    def keeps_history(self) -> bool:
        """A token pool that keeps every token of a live page (full-history pool)."""
        return self.id_space is IdSpace.PAGE and self.max_span is None

    @property
    def releases_history(self) -> bool:
        """A token pool whose pages may leave (tombstoned) while the page stays live."""
        return self.id_space is IdSpace.PAGE and self.max_span is not None


@dataclass(frozen=True)
class _AllTokens(PoolId):
    """Rule shared by full-history token pools: ``[0, L)``."""

    id_space: ClassVar[IdSpace] = IdSpace.PAGE

    def first_needed(self, seq_len: Positions) -> Positions:
        return seq_len * 0

    @property
    def max_span(self) -> int | None:
        return None


@dataclass(frozen=True)
class FullPool(_AllTokens):
    """K and V of full (MHA/GQA) attention layers."""

    family: ClassVar[str] = "full"
    rank: ClassVar[int] = 0


@dataclass(frozen=True)
class LatentPool(_AllTokens):
    """The compressed latent of MLA layers."""

    family: ClassVar[str] = "mla"
    rank: ClassVar[int] = 1


@dataclass(frozen=True)
class WindowPool(PoolId):
    """K and V of sliding-window layers with one window: ``[max(0, L - window), L)``."""

    window: int
    family: ClassVar[str] = "swa"
    id_space: ClassVar[IdSpace] = IdSpace.PAGE
    rank: ClassVar[int] = 2

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise PoolIdError(f"window pool needs a positive window, got {self.window}")

    @property
    def param(self) -> int | None:
        return self.window

    @classmethod
    def from_param(cls, param: int | None) -> PoolId:
        if param is None:
            raise PoolIdError("a window pool id needs its window, e.g. 'swa:1024'")
        return cls(param)

    def first_needed(self, seq_len: Positions) -> Positions:
        return (seq_len - self.window) * (seq_len > self.window)

    @property
    def max_span(self) -> int | None:
        return self.window


@dataclass(frozen=True)
class RecurrentPool(PoolId):
    """Per-request state of recurrent layers: no tokens, one state at exactly ``L``."""

    family: ClassVar[str] = "state"
    id_space: ClassVar[IdSpace] = IdSpace.SLOT
    rank: ClassVar[int] = 3
    needs_state: ClassVar[bool] = True

    def first_needed(self, seq_len: Positions) -> Positions:
        return seq_len

    @property
    def max_span(self) -> int | None:
        return 0


FULL_POOL = FullPool()
MLA_POOL = LatentPool()
RECURRENT_POOL = RecurrentPool()
