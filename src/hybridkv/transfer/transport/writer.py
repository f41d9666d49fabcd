"""Writing one plan through a transport: in chunks, one in flight at a time, stoppable between chunks.

Invariants: a write returns only once every op it submitted landed (``DONE``), or raises:
``TransportError`` with the transport's reason for a failed chunk, ``TransferError("stopped: ...")``
when ``stop()`` answered, and then only once nothing is in flight (a submitted chunk cannot be
recalled). With a ``SourceStaging``, strided sources of a chunk are gathered into its buffer first,
so a transport that pays per op sends one op per destination run. A plan that fits one chunk
(a small request) is submitted as the plan holds it, without slicing, and over a transport
that ``waits_inline`` written and waited for on this thread (``submit_wait``); ``stop()`` is
then asked once the chunk ended (a chunk cannot be recalled, so it is waited for either way).
"""

from __future__ import annotations

from collections.abc import Callable

from hybridkv.transfer.errors import TransferError, TransportError
from hybridkv.transfer.ops import TransferPlan
from hybridkv.transfer.transport.base import Completion, Transport
from hybridkv.transfer.transport.staging import SourceStaging

STOP_CHECK_S = 0.05
"""How often ``write_plan`` asks its ``stop`` callback while a submitted chunk is in flight."""


def write_plan(
    transport: Transport,
    peer: str,
    plan: TransferPlan,
    chunk_bytes: int,
    stop: Callable[[], str],
    stage: SourceStaging | None = None,
) -> int:
    """Write ``plan`` in chunks (at most ``max_ops_per_submit`` ops, about ``chunk_bytes``;
    with ``stage``, what ``stage.limit`` says: its buffer's bytes for a plan of small ops,
    which it may stage, ``chunk_bytes`` otherwise), one chunk in flight at a time; returns the
    ops submitted once every op landed (fewer than the plan's where ``stage`` gathered a
    chunk's strided sources: one op per destination run).

    ``stop()`` is asked before every chunk and every ``STOP_CHECK_S`` while one is in
    flight; a non-empty answer ends the write with ``TransferError("stopped: <answer>")``
    once nothing is in flight any more (a submitted chunk cannot be recalled), so an abort
    or a deadline takes effect at the next chunk boundary. A failed chunk raises
    ``TransportError`` with the transport's reason.
    """
    submitted = 0
    limit = chunk_bytes if stage is None else stage.limit(plan, chunk_bytes)
    chunks: list[slice] | tuple[None]
    if 0 < plan.num_ops <= transport.max_ops_per_submit and plan.nbytes <= limit:
        chunks = (None,)  # one chunk (a small request): the plan's own op lists, no slicing
    else:
        chunks = plan.chunks(transport.max_ops_per_submit, limit)
    for chunk in chunks:
        reason = stop()
        if reason:
            raise TransferError(f"stopped: {reason}")
        src, dst, length = plan.ops(chunk)
        bounds = plan.bounds
        if stage is not None:
            src, dst, length, bounds = stage.gather(src, dst, length, bounds)
        submitted += len(dst)
        if chunk is None and transport.waits_inline:  # one chunk: written and waited for on this thread
            status = transport.submit_wait(peer, src, dst, length, bounds)
            reason = stop()  # asked once it was in flight, as the polled path asks
        else:
            handle = transport.submit(peer, src, dst, length, bounds)
            status = transport.poll(handle)
            while not status.ended:
                reason = reason or stop()
                status = transport.wait(handle, STOP_CHECK_S)
        if status.completion is Completion.FAILED:
            raise TransportError(status.reason)
        if reason:
            raise TransferError(f"stopped: {reason}")
    return submitted
