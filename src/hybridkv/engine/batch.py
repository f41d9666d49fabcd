"""ForwardBatch: what one forward step computes, in virtual ids only.

A step runs several requests at once: request ``i`` already holds ``prefix_lens[i]`` tokens
in memory and adds ``extend_lens[i]`` new ones (a prefill chunk, or 1 for a decode).

Invariants (checked at construction, on the host):
- ``input_ids`` are the new tokens, request after request (``sum(extend_lens)`` of them).
- ``token_locs[i]`` holds request ``i``'s virtual token locations for its whole context
  after the step (``prefix_lens[i] + extend_lens[i]`` of them); the new tokens' locations
  are already allocated. Locations are virtual: the runner translates them once per step,
  so compaction between steps is harmless.
- ``state_slots[i]`` is request ``i``'s virtual state slot (models with recurrent layers),
  and ``fresh_state[i]`` says its state starts from zero (first chunk of a request without a
  cached state); otherwise the slot holds the state after ``prefix_lens[i]`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class BatchError(ValueError):
    """A forward batch whose parts do not fit together."""


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    token_locs: tuple[np.ndarray, ...]
    state_slots: np.ndarray | None = None
    fresh_state: np.ndarray | None = None

    @classmethod
    def build(
        cls,
        input_ids: list[np.ndarray] | list[list[int]],
        prefix_lens: list[int] | np.ndarray,
        token_locs: list[np.ndarray],
        state_slots: list[int] | np.ndarray | None = None,
        fresh_state: list[bool] | np.ndarray | None = None,
    ) -> ForwardBatch:
        """From per-request new tokens; ``extend_lens`` are their lengths."""
        ids = [np.asarray(x, dtype=np.int64).reshape(-1) for x in input_ids]
        return cls(
            input_ids=np.concatenate(ids) if ids else np.empty(0, dtype=np.int64),
            prefix_lens=np.asarray(prefix_lens, dtype=np.int64),
            extend_lens=np.array([x.size for x in ids], dtype=np.int64),
            token_locs=tuple(np.asarray(t, dtype=np.int64) for t in token_locs),
            state_slots=None if state_slots is None else np.asarray(state_slots, dtype=np.int64),
            fresh_state=None if fresh_state is None else np.asarray(fresh_state, dtype=bool),
        )

    def __post_init__(self) -> None:
        r = self.prefix_lens.size
        if r == 0:
            raise BatchError("a forward batch needs at least one request")
        if self.extend_lens.size != r or len(self.token_locs) != r:
            raise BatchError(
                f"{r} prefix_lens, {self.extend_lens.size} extend_lens and {len(self.token_locs)} token_locs; "
                "give one of each per request"
            )
        if (self.extend_lens < 1).any() or (self.prefix_lens < 0).any():
            raise BatchError(
                f"every request needs >= 1 new token and a prefix >= 0 (extend_lens {self.extend_lens.tolist()}, "
                f"prefix_lens {self.prefix_lens.tolist()})"
            )
        if self.input_ids.size != int(self.extend_lens.sum()):
            raise BatchError(f"{self.input_ids.size} input ids but extend_lens sum to {int(self.extend_lens.sum())}")
        seq = self.seq_lens
        for i, locs in enumerate(self.token_locs):
            if locs.size != seq[i]:
                raise BatchError(
                    f"request {i}: {locs.size} token locations for a context of {seq[i]} tokens "
                    f"(prefix {self.prefix_lens[i]} + {self.extend_lens[i]} new)"
                )
        for name, arr in (("state_slots", self.state_slots), ("fresh_state", self.fresh_state)):
            if arr is not None and arr.size != r:
                raise BatchError(f"{name} has {arr.size} entries for {r} requests")
        if (self.state_slots is None) != (self.fresh_state is None):
            raise BatchError("give state_slots and fresh_state together")

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
