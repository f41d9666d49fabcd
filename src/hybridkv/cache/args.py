"""Argument checks at the cache's API edge: a wrong type is refused with a ``CacheError``
naming the argument, before anything changes (never a bare TypeError from deep inside).

Integers are Python ints or numpy integers; ``bool`` is refused (``True`` is not a count).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hybridkv.cache.errors import CacheError


def integer(value: object, what: str, *, minimum: int | None = None) -> int:
    """``value`` as an int, or a ``CacheError`` naming ``what``."""
    if type(value) is int and (minimum is None or value >= minimum):
        return value  # the common case
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise CacheError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    out = int(value)
    if minimum is not None and out < minimum:
        raise CacheError(f"{what} must be >= {minimum}, got {out}")
    return out


def mapping(value: object, what: str) -> Mapping[object, object]:
    if type(value) is dict:
        return value  # the common case, without an ABC check
    if not isinstance(value, Mapping):
        raise CacheError(f"{what} must be a mapping (a dict), got {type(value).__name__} {value!r}")
    return value


def as_array(value: object) -> np.ndarray:
    """``np.asarray``; a ragged or unconvertible value comes back as an empty 2-D object array,
    which every caller's shape and dtype check refuses with its own message."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError):
        return np.empty((0, 0), dtype=object)
