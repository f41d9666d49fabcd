"""The cross-tier hit rule: the longest prefix whose every component is restorable from some tier.

The device's rule (``cache/rules.py``) per kind, with "resident" widened to "held by the
device, host memory or the store": a hit of ``E`` pages needs
- full KV of every page in ``[0, E)`` (every full-history pool);
- for each window pool, the pages of the span its pool id needs before ``E``
  (``first_needed(E * page_size) // page_size`` up to ``E``);
- with recurrent layers, a state checkpoint taken after exactly ``E`` pages.

``cross_tier_hit`` is a pure function of where each piece is (``Residency``: one tier code
per page and component, the best, i.e. cheapest, tier that holds it) and answers the
largest valid ``E`` with, for every needed piece, the tier to restore it from. An engine
calls it at admission with the device's residency (a walk of its tree) merged with the
host's and the store's; with device-only residency it answers exactly the device's own
hit (``tests/tiers/test_hit.py`` proves both against a brute-force oracle and the cache).

Invariant: every tier code in the answer's ranges is a real tier (never ``NOWHERE``);
``E == 0`` is always valid (nothing to restore).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from hybridkv.spec import PoolId


class Where(IntEnum):
    """Tiers, cheapest first (a smaller code is a better source)."""

    DEVICE = 0
    HOST = 1
    STORE = 2
    NOWHERE = 3


TIERS = (Where.DEVICE, Where.HOST, Where.STORE)


@dataclass(frozen=True)
class Residency:
    """Where a request's pieces are, page by page (``int8`` tier codes)."""

    full: np.ndarray
    """``(n,)``: page ``i``'s full KV restorable from this tier (the slowest of the full-history
    pools' best tiers: the pools are restored together)."""
    windows: tuple[np.ndarray, ...]
    """One ``(n,)`` array per window pool (the rules' order): page ``i``'s window cells."""
    checkpoints: np.ndarray | None
    """``(n + 1,)``: a state after ``e`` pages (index 0 unused); None without recurrent layers."""

    @property
    def pages(self) -> int:
        return int(self.full.size)


@dataclass(frozen=True)
class TierHit:
    pages: int
    """The hit's end, in pages: ``[0, pages)`` is restorable for every component."""
    page_size: int
    full: np.ndarray
    """Tier of each page's full KV, pages ``[0, pages)``."""
    windows: tuple[tuple[int, np.ndarray], ...]
    """Per window pool: (first needed page, tiers of pages ``[first, pages)``)."""
    checkpoint: Where | None
    """Tier of the state after ``pages`` pages (None without recurrent layers or for an empty hit)."""

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    def full_tokens(self) -> dict[Where, int]:
        """Hit tokens by the tier their full KV comes from."""
        counts = np.bincount(self.full, minlength=len(Where))
        return {t: int(counts[t]) * self.page_size for t in TIERS}


def _first_pages(pool: PoolId, ends: np.ndarray, page_size: int) -> np.ndarray:
    return np.asarray(pool.first_needed(ends * page_size)) // page_size


def cross_tier_hit(res: Residency, page_size: int, windows: Sequence[PoolId], upto_pages: int | None = None) -> TierHit:
    """The longest hit valid for every component over all tiers, at most ``upto_pages``."""
    if len(windows) != len(res.windows):
        raise ValueError(f"{len(windows)} window pools but residency for {len(res.windows)}")
    n = res.pages if upto_pages is None else min(upto_pages, res.pages)
    full = res.full[:n]
    gaps = np.flatnonzero(full == Where.NOWHERE)
    reach = int(gaps[0]) if gaps.size else n
    ends = np.arange(1, reach + 1)
    valid = np.ones(reach, dtype=bool)
    if res.checkpoints is not None:
        valid &= res.checkpoints[1 : reach + 1] != Where.NOWHERE
    firsts = []
    for pool, where in zip(windows, res.windows, strict=True):
        missing = np.concatenate([[0], np.cumsum(where[:reach] == Where.NOWHERE)])
        lo = _first_pages(pool, ends, page_size)
        valid &= missing[ends] == missing[lo]
        firsts.append(lo)
    good = np.flatnonzero(valid)
    end = int(good[-1]) + 1 if good.size else 0
    spans = []
    for lo, where in zip(firsts, res.windows, strict=True):
        first = int(lo[end - 1]) if end else 0
        spans.append((first, where[first:end].copy()))
    checkpoint = None
    if res.checkpoints is not None and end:
        checkpoint = Where(int(res.checkpoints[end]))
    return TierHit(end, page_size, full[:end].copy(), tuple(spans), checkpoint)
