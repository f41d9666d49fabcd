"""Errors of the cache package. A refused call leaves the tree and the pools as they were."""

from __future__ import annotations


class CacheError(ValueError):
    """Base class: a prefix-cache call refused; nothing in the tree or the pools changed."""


class LockError(CacheError):
    """An unlock without a matching lock, a double unlock, or a lock of a node not in the tree."""


class InsertError(CacheError):
    """An insert whose tokens, pages or state slots do not fit together or are not the caller's."""
