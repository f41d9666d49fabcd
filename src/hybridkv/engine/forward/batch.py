"""ForwardBatch: what one forward step computes, in virtual ids only.

A step runs several requests at once: request ``i`` already holds ``prefix_lens[i]`` tokens
in memory and adds ``extend_lens[i]`` new ones (a prefill chunk, or 1 for a decode).

Invariants (checked at construction, on the host):
- ``input_ids`` are the new tokens, request after request (``sum(extend_lens)`` of them).
- Where request ``i``'s context lives after the step (``prefix_lens[i] + extend_lens[i]`` tokens,
  the new tokens' places already allocated), in one of two forms: ``token_locs[i]``, its
  virtual token locations (``build``), or ``pages[i]``, its virtual page ids (row page ``k``
  holds positions ``[k * page_size, (k + 1) * page_size)``; ``from_pages``, what a scheduler
  holding page rows gives without expanding them per token every step). Ids are virtual: the
  runner translates them once per step, so compaction between steps is harmless.
- ``state_slots[i]`` is request ``i``'s virtual state slot (models with recurrent layers),
  and ``fresh_state[i]`` says its state starts from zero (first chunk of a request without a
  cached state); otherwise the slot holds the state after ``prefix_lens[i]`` tokens.
  ``checkpoint_slots[i]`` (optional, -1 for none) is a reserved checkpoint slot that gets a copy
  of request ``i``'s state after its new tokens, written with the running state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


class BatchError(ValueError):
    """A forward batch whose parts do not fit together."""


def _ids(input_ids: list[np.ndarray] | list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    if all(type(x) is list for x in input_ids):  # the scheduler's spans: one conversion for the step, not one a row
        sizes = np.fromiter(map(len, input_ids), dtype=np.int64, count=len(input_ids))
        return np.fromiter(itertools.chain.from_iterable(input_ids), dtype=np.int64, count=int(sizes.sum())), sizes
    ids = [np.asarray(x, dtype=np.int64).reshape(-1) for x in input_ids]
    flat = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
    return flat, np.array([x.size for x in ids], dtype=np.int64)


def _slots(
    state_slots: list[int] | np.ndarray | None, fresh_state: list[bool] | np.ndarray | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    slots = None if state_slots is None else np.asarray(state_slots, dtype=np.int64)
    return slots, None if fresh_state is None else np.asarray(fresh_state, dtype=bool)


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    token_locs: tuple[np.ndarray, ...] | None
    state_slots: np.ndarray | None = None
    fresh_state: np.ndarray | None = None
    pages: tuple[np.ndarray, ...] | None = None
    page_size: int | None = None
    checkpoint_slots: np.ndarray | None = None
    logit_rows: np.ndarray | None = None
    """Requests (batch rows) whose every new token's logits are wanted too, after the last-token rows."""

    @classmethod
    def build(
        cls,
        input_ids: list[np.ndarray] | list[list[int]],
        prefix_lens: list[int] | np.ndarray,
        token_locs: list[np.ndarray],
        state_slots: list[int] | np.ndarray | None = None,
        fresh_state: list[bool] | np.ndarray | None = None,
    ) -> ForwardBatch:
        """From per-request new tokens and token locations; ``extend_lens`` are the new tokens' counts."""
        flat, ext = _ids(input_ids)
        return cls(
            flat,
            np.asarray(prefix_lens, dtype=np.int64),
            ext,
            tuple(np.asarray(t, dtype=np.int64) for t in token_locs),
            *_slots(state_slots, fresh_state),
        )

    @classmethod
    def from_pages(
        cls,
        input_ids: list[np.ndarray] | list[list[int]],
        prefix_lens: list[int] | np.ndarray,
        pages: list[np.ndarray],
        page_size: int,
        state_slots: list[int] | np.ndarray | None = None,
        fresh_state: list[bool] | np.ndarray | None = None,
        checkpoint_slots: list[int] | np.ndarray | None = None,
        logit_rows: list[int] | None = None,
    ) -> ForwardBatch:
        """From per-request new tokens and page rows (``KVHandle.pages``: at least the context's pages)."""
        flat, ext = _ids(input_ids)
        return cls(
            flat,
            np.asarray(prefix_lens, dtype=np.int64),
            ext,
            None,
            *_slots(state_slots, fresh_state),
            pages=tuple(np.asarray(p, dtype=np.int64) for p in pages),
            page_size=page_size,
            checkpoint_slots=None if checkpoint_slots is None else np.asarray(checkpoint_slots, dtype=np.int64),
            logit_rows=np.asarray(logit_rows, dtype=np.int64) if logit_rows else None,
        )

    def __post_init__(self) -> None:
        r = self.prefix_lens.size
        if r == 0:
            raise BatchError("a forward batch needs at least one request")
        rows = self.token_locs if self.token_locs is not None else self.pages
        if rows is None or (self.token_locs is not None and self.pages is not None):
            raise BatchError("give each request's context as token_locs or as pages (one of the two)")
        if self.extend_lens.size != r or len(rows) != r:
            raise BatchError(
                f"{r} prefix_lens, {self.extend_lens.size} extend_lens and {len(rows)} "
                f"{'token_locs' if self.token_locs is not None else 'page rows'}; give one of each per request"
            )
        if (self.extend_lens < 1).any() or (self.prefix_lens < 0).any():
            raise BatchError(
                f"every request needs >= 1 new token and a prefix >= 0 (extend_lens {self.extend_lens.tolist()}, "
                f"prefix_lens {self.prefix_lens.tolist()})"
            )
        if self.input_ids.size != int(self.extend_lens.sum()):
            raise BatchError(f"{self.input_ids.size} input ids but extend_lens sum to {int(self.extend_lens.sum())}")
        seq = self.seq_lens
        sizes = np.fromiter((a.size for a in rows), dtype=np.int64, count=r)
        if self.token_locs is not None:
            bad = np.flatnonzero(sizes != seq)
            if bad.size:
                i = int(bad[0])
                raise BatchError(
                    f"request {i}: {sizes[i]} token locations for a context of {seq[i]} tokens "
                    f"(prefix {self.prefix_lens[i]} + {self.extend_lens[i]} new)"
                )
        else:
            if self.page_size is None or self.page_size < 1:
                raise BatchError(f"page rows need a page size >= 1 (got {self.page_size})")
            bad = np.flatnonzero(sizes * self.page_size < seq)
            if bad.size:
                i = int(bad[0])
                raise BatchError(
                    f"request {i}: {sizes[i]} pages of {self.page_size} tokens cannot hold a context of {seq[i]} "
                    f"tokens (prefix {self.prefix_lens[i]} + {self.extend_lens[i]} new)"
                )
        named = (("state_slots", self.state_slots), ("fresh_state", self.fresh_state))
        for name, arr in (*named, ("checkpoint_slots", self.checkpoint_slots)):
            if arr is not None and arr.size != r:
                raise BatchError(f"{name} has {arr.size} entries for {r} requests")
        if (self.state_slots is None) != (self.fresh_state is None):
            raise BatchError("give state_slots and fresh_state together")
        if self.checkpoint_slots is not None and self.state_slots is None:
            raise BatchError("checkpoint_slots copy the requests' states: give state_slots too")

    @property
    def seq_lens(self) -> np.ndarray:
        return self.prefix_lens + self.extend_lens

    @property
    def positions(self) -> np.ndarray:
        """Position of every new token in its request's context, flat like ``input_ids``."""
        ext = self.extend_lens
        req = np.repeat(np.arange(ext.size), ext)
        starts = np.cumsum(ext) - ext
        return self.prefix_lens[req] + np.arange(req.size) - starts[req]

    def page_table(self, page_size: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, base)``: every request's context pages, virtual ids, concatenated (request ``i``'s page ``k`` is
        ``ids[base[i] + k]``), for a memory of ``page_size`` tokens a page."""
        seq = self.seq_lens
        counts = -(-seq // page_size)
        base = np.cumsum(counts) - counts
        if self.pages is not None:
            if self.page_size != page_size:
                raise BatchError(f"page rows of {self.page_size} tokens a page for a memory of {page_size}")
            return np.concatenate([p[:n] for p, n in zip(self.pages, counts.tolist(), strict=True)]), base  # int slices
        assert self.token_locs is not None
        locs = np.concatenate(self.token_locs)
        starts = np.cumsum(seq) - seq
        at = np.repeat(starts - base * page_size, counts) + page_size * np.arange(int(counts.sum()))
        return locs[at] // page_size, base
