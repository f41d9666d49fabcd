"""Errors of the memory package. Every one leaves the pools exactly as they were."""

from __future__ import annotations

from hybridkv.spec import IdSpace, PoolId


class MemoryPoolError(Exception):
    """Base class: a memory operation refused; nothing was changed."""


class OutOfMemory(MemoryPoolError):
    """Not enough free cells, free slabs or movable bytes for the request."""

    def __init__(self, message: str, short: dict[PoolId | IdSpace, int] | None = None):
        super().__init__(message)
        self.short: dict[PoolId | IdSpace, int] = short or {}
        """What was missing when the request was refused: cells per pool id, or virtual ids
        per id space (``IdSpace.PAGE`` / ``IdSpace.SLOT``)."""


class InvalidIds(MemoryPoolError, ValueError):
    """Ids that are out of range, never allocated, already freed, duplicated, misaligned or
    shared by two requests; or a count, length or position that is not an int >= 0."""


class PinnedError(MemoryPoolError):
    """An operation needs to move or free a page that a move gate still pins."""


class LayoutError(MemoryPoolError, ValueError):
    """A budget, geometry or layout that cannot work; the message names what to change."""
