"""Errors of the transfer package.

Every error is raised *before* a byte moves where it can be (layouts, pairing, plans), and
its message names both sides (prefill and decode rank) and what to change.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every transfer failure."""


class BadLayout(TransferError, ValueError):
    """One side published a buffer layout that is inconsistent in itself."""


class LayoutMismatch(TransferError, ValueError):
    """Prefill and decode layouts cannot be paired (missing layer, size, dtype, page size)."""


class PlanError(TransferError, ValueError):
    """A request's pages, slots or addresses do not fit the layouts or registered memory."""


class ProtocolError(TransferError, ValueError):
    """A control message that is malformed, unexpected, forged or out of order."""


class TransportError(TransferError):
    """The transport failed to move the bytes; the destination is undefined."""
