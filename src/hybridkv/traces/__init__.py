"""Real request traces shipped inside the package (``hybridkv/traces/data/``), and their loaders.

- ``peer_trace.json.gz``: deterministic allocator / prefix-cache replay trace with exact
  call protocols (``alloc`` and ``radix`` parts); see ``traces/data/README.md``.
- ``mooncake_conversation_trace.jsonl.gz``: the conversation workload of the public
  Mooncake FAST'25 trace (Kimi production service, Apache-2.0): arrival time, input and
  output lengths, and prefix-block hashes of 512 tokens.

Every row is validated against a msgspec schema before use (integers stay integers, lengths
and times in range, ids unique): a bad row is a ``TraceError`` naming the file, line or request
and the field, never a crash or a silent conversion later.

Loaders accept a built-in trace name (``TRACES``: read with ``importlib.resources``, so they
work from an installed wheel as well as from a checkout) or a path to a plain or gzip file (by
the ``.gz`` suffix), and validate the fields they use.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from hybridkv.registry import Registry

_DATA = resources.files("hybridkv.traces").joinpath("data")
PEER_TRACE = "peer"
MOONCAKE_TRACE = "mooncake-conversation"
TRACES = Registry[Traversable]("built-in trace")
TRACES.add(PEER_TRACE, _DATA.joinpath("peer_trace.json.gz"))
TRACES.add(MOONCAKE_TRACE, _DATA.joinpath("mooncake_conversation_trace.jsonl.gz"))
MOONCAKE_BLOCK_TOKENS = 512

MAX_REQUEST_TOKENS = 1 << 24  # 16M tokens: above any model's context, small enough to materialize

TraceSource = str | Path

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_REQUEST_TOKENS)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_REQUEST_TOKENS)]
Id = Annotated[int, msgspec.Meta(ge=0)]
Millis = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class _MooncakeRow(msgspec.Struct):
    timestamp: Millis
    input_length: Positive
    output_length: Count
    hash_ids: list[Id]


class _AllocRow(msgspec.Struct):
    rid: Id
    arrival: Seconds
    prompt_len: Positive
    output_len: Count


class _RadixRow(msgspec.Struct):
    rid: Id
    arrival: Seconds
    conv_id: Id
    turn: Annotated[int, msgspec.Meta(ge=0)]
    sys_id: Id
    prev_rid: int
    user_ids: list[int]
    output_ids: list[int]


class TraceError(ValueError):
    """A trace file that is missing or does not have the fields a replay needs."""


def trace_file(source: TraceSource) -> Traversable:
    """A built-in trace name (see ``TRACES``) or a path -> the file to read; missing raises."""
    if isinstance(source, str) and source in TRACES:
        return TRACES[source]
    path = Path(source)
    if not path.is_file():
        raise TraceError(
            f"trace {str(source)!r} is neither a built-in trace ({', '.join(TRACES)}) nor an existing file"
        )
    return path


def _open_text(source: TraceSource) -> str:
    file = trace_file(source)
    try:
        raw = file.read_bytes()
        if file.name.endswith(".gz"):
            raw = gzip.decompress(raw)
        return raw.decode()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceError(f"trace {str(source)!r} cannot be read: {exc}") from exc


def load_peer_trace(path: TraceSource = PEER_TRACE) -> dict[str, Any]:
    try:
        data = json.loads(_open_text(path))
    except ValueError as exc:
        raise TraceError(f"{path}: not a JSON peer trace ({exc})") from None
    for part, keys in (
        ("alloc", ("requests", "events", "peak_live_pages")),
        ("radix", ("system_prompts", "requests")),
    ):
        if not isinstance(data, dict) or not isinstance(data.get(part), dict) or any(k not in data[part] for k in keys):
            raise TraceError(f"{path}: expected a {part!r} section with {keys}")
    _check_rows(path, "alloc", data["alloc"]["requests"], _AllocRow)
    _check_rows(path, "radix", data["radix"]["requests"], _RadixRow)
    prompts = data["radix"]["system_prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, list) and p for p in prompts):
        raise TraceError(f"{path}: radix system_prompts must be a list of non-empty token lists")
    return data


def _check_rows(path: TraceSource, part: str, rows: object, schema: type[msgspec.Struct]) -> None:
    try:
        checked = msgspec.convert(rows, type=list[schema])  # type: ignore[valid-type]
    except msgspec.ValidationError as exc:
        raise TraceError(f"{path}: {part} requests: {exc}") from None
    ids = [row.rid for row in checked]  # type: ignore[attr-defined]
    if len(set(ids)) != len(ids):
        dup = next(r for i, r in enumerate(ids) if r in ids[:i])
        raise TraceError(f"{path}: {part} request id {dup} appears more than once")


@dataclass(frozen=True)
class MooncakeRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def input_tokens(self) -> np.ndarray:
        """Synthetic token ids: block ``h`` expands to ``h * 512 + [0, 512)``, cut to length."""
        ids = np.asarray(self.hash_ids, dtype=np.int64)
        tokens = (ids[:, None] * MOONCAKE_BLOCK_TOKENS + np.arange(MOONCAKE_BLOCK_TOKENS)).reshape(-1)
        return tokens[: self.input_length]


_MOONCAKE_ROW = msgspec.json.Decoder(_MooncakeRow)


def load_mooncake_trace(path: TraceSource = MOONCAKE_TRACE, limit: int | None = None) -> list[MooncakeRequest]:
    out = []
    for lineno, line in enumerate(_open_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = _MOONCAKE_ROW.decode(line)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise TraceError(f"{path}:{lineno}: bad request record ({exc})") from None
        req = MooncakeRequest(row.timestamp, row.input_length, row.output_length, tuple(row.hash_ids))
        if req.input_length > len(req.hash_ids) * MOONCAKE_BLOCK_TOKENS:
            raise TraceError(f"{path}:{lineno}: input_length {req.input_length} exceeds {len(req.hash_ids)} blocks")
        out.append(req)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise TraceError(f"{path}: the trace holds no requests")
    return out
