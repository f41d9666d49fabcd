"""Workloads a replay serves: requests with arrival times and real token ids, made lazily.

Two formats (``traces.py`` loads them):
- the Mooncake JSONL trace: each 512-token hash block expands to ``hash_id * 512 + i`` (cut
  to ``input_length``); the ``output_length`` generated tokens are fresh ids that no other
  request shares (``OUTPUT_BASE + rid * 2**24 + i``, above every input id);
- the ``radix`` part of ``peer_trace.json``: real token ids (system prompt + turns); a
  later turn's input is the previous turn's input + its ``output_ids`` + the new user
  turn, so it may only arrive once that previous turn has finished (``after``). Its
  ``arrival`` field is read as seconds.

A request keeps its lengths and the source of its ids (a Mooncake row's block ids, or the
explicit ids of a radix turn); ``input_ids()`` / ``output_ids()`` build the arrays when called
(the simulator calls them when it admits the request and drops them when it finishes), so a
workload of a whole trace holds kilobytes of block ids, not every request's tokens at once.

Invariants: requests are sorted by arrival (ties keep trace order); ``rid`` is the position
in that order; every request has at least one input token and ``after`` (when set) names
an earlier request; ``input_ids()`` has ``input_length`` ids, ``output_ids()``
``output_length``, the same every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridkv.traces import (
    MOONCAKE_BLOCK_TOKENS,
    SYNTHETIC_ID_LIMIT,
    TraceError,
    load_mooncake_trace,
    load_peer_trace,
    trace_file,
)

OUTPUT_BASE = SYNTHETIC_ID_LIMIT  # above every input id of a trace (traces caps hash and token ids)
_OUTPUT_STRIDE = 1 << 24


@dataclass(frozen=True)
class ReplayRequest:
    rid: int
    arrival_s: float
    input_length: int
    output_length: int
    after: int | None = None
    """A request that must finish before this one arrives (the previous turn)."""
    blocks: np.ndarray | None = None
    """Mooncake hash block ids (int64): block ``h`` holds ids ``h * 512 + [0, 512)``."""
    prompt: np.ndarray | None = None
    """Explicit input ids (int64), when not made from blocks."""
    generated: np.ndarray | None = None
    """Explicit output ids (int64); default: fresh ids no other request shares."""

    def __post_init__(self) -> None:
        if (self.blocks is None) == (self.prompt is None):
            raise TraceError(f"request {self.rid}: give its input as block ids or as explicit ids (one of them)")
        if self.prompt is not None and self.prompt.size != self.input_length:
            raise TraceError(f"request {self.rid}: {self.prompt.size} input ids for input_length {self.input_length}")
        if self.blocks is not None and self.blocks.size * MOONCAKE_BLOCK_TOKENS < self.input_length:
            raise TraceError(
                f"request {self.rid}: {self.blocks.size} blocks of {MOONCAKE_BLOCK_TOKENS} tokens cannot "
                f"hold input_length {self.input_length}"
            )
        if self.generated is not None and self.generated.size != self.output_length:
            raise TraceError(
                f"request {self.rid}: {self.generated.size} output ids for output_length {self.output_length}"
            )

    @classmethod
    def from_ids(
        cls, rid: int, arrival_s: float, tokens: np.ndarray, output: np.ndarray, after: int | None = None
    ) -> ReplayRequest:
        """A request with explicit input and output ids."""
        prompt, generated = np.asarray(tokens, dtype=np.int64), np.asarray(output, dtype=np.int64)
        return cls(rid, arrival_s, int(prompt.size), int(generated.size), after, None, prompt, generated)

    def input_ids(self) -> np.ndarray:
        """The input token ids (int64), built now: hold them only while the request runs."""
        if self.prompt is not None:
            return self.prompt
        assert self.blocks is not None
        blocks = self.blocks[: -(-self.input_length // MOONCAKE_BLOCK_TOKENS)]
        ids = (blocks[:, None] * MOONCAKE_BLOCK_TOKENS + np.arange(MOONCAKE_BLOCK_TOKENS)).reshape(-1)
        return ids[: self.input_length]

    def output_ids(self) -> np.ndarray:
        """The generated token ids (int64), built now."""
        if self.generated is not None:
            return self.generated
        return OUTPUT_BASE + self.rid * _OUTPUT_STRIDE + np.arange(self.output_length, dtype=np.int64)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[ReplayRequest, ...]
    shared_block_tokens: int = 0
    """Its prompts share content only in whole blocks of this many tokens (a Mooncake trace:
    its hash blocks), so a hit ends on such a block's end; 0: any token."""

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)


def detect_format(path: str | Path) -> str:
    name = trace_file(path).name.removesuffix(".gz")
    if name.endswith(".jsonl"):
        return "mooncake"
    if name.endswith(".json"):
        return "radix"
    raise TraceError(
        f"{path}: cannot tell the trace format from the name; pass a Mooncake .jsonl(.gz) or a "
        "peer_trace .json(.gz), or name the format explicitly"
    )


def load_workload(path: str | Path, fmt: str = "auto", limit: int | None = None) -> Workload:
    """Load ``limit`` requests (default all) of a Mooncake or peer ``radix`` trace."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "mooncake":
        return _mooncake(path, limit)
    if fmt == "radix":
        return _radix(path, limit)
    raise TraceError(f"unknown trace format {fmt!r}; use 'mooncake', 'radix' or 'auto'")


def _mooncake(path: str | Path, limit: int | None) -> Workload:
    rows = load_mooncake_trace(path, limit=limit)
    order = sorted(range(len(rows)), key=lambda i: rows[i].timestamp_ms)
    requests = []
    for rid, i in enumerate(order):
        row = rows[i]
        if row.input_length < 1:
            raise TraceError(f"{path}: request {i} has no input tokens")
        blocks = np.asarray(row.hash_ids, dtype=np.int64)
        requests.append(
            ReplayRequest(rid, row.timestamp_ms / 1000.0, row.input_length, row.output_length, None, blocks)
        )
    return Workload(f"mooncake:{trace_file(path).name}", tuple(requests), MOONCAKE_BLOCK_TOKENS)


def _radix(path: str | Path, limit: int | None) -> Workload:
    part = load_peer_trace(path)["radix"]
    prompts = part["system_prompts"]
    rows = part["requests"][:limit] if limit is not None else part["requests"]
    order = sorted(range(len(rows)), key=lambda i: rows[i]["arrival"])
    rid_of = {rows[i]["rid"]: rid for rid, i in enumerate(order)}
    seq_of: dict[int, np.ndarray] = {}
    requests = []
    for rid, i in enumerate(order):
        row = rows[i]
        user = np.asarray(row["user_ids"], dtype=np.int64)
        after = None
        if row["turn"] == 0:
            tokens = np.concatenate([np.asarray(prompts[row["sys_id"]], dtype=np.int64), user])
        else:
            prev = row["prev_rid"]
            if prev not in rid_of or rid_of[prev] >= rid:
                raise TraceError(f"{path}: request {row['rid']} follows {prev}, which is not an earlier request")
            after = rid_of[prev]
            tokens = np.concatenate([seq_of[prev], user])
        output = np.asarray(row["output_ids"], dtype=np.int64)
        seq_of[row["rid"]] = np.concatenate([tokens, output])
        requests.append(ReplayRequest.from_ids(rid, float(row["arrival"]), tokens, output, after))
    return Workload(f"radix:{trace_file(path).name}", tuple(requests))
