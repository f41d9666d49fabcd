"""Real request traces shipped inside the package (``hybridkv/traces/data/``), and their loaders.

- ``peer_trace.json.gz``: deterministic allocator / prefix-cache replay trace with exact
  call protocols (``alloc`` and ``radix`` parts); see ``traces/data/README.md``.
- ``mooncake_conversation_trace.jsonl.gz``: the conversation workload of the public
  Mooncake FAST'25 trace (Kimi production service, Apache-2.0): arrival time, input and
  output lengths, and prefix-block hashes of 512 tokens.

Every row is validated against a msgspec schema before use (integers stay integers, lengths
and times in range, ids unique, token ids in ``[0, MAX_TOKEN_ID]``, Mooncake hash ids at most
``MAX_HASH_ID`` so that their synthetic token ids stay below ``SYNTHETIC_ID_LIMIT``, every
``sys_id`` naming a system prompt): a bad row is a ``TraceError`` naming the file, line or
request (its ``rid``) and the field, never a crash or a silent conversion later.

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
MAX_TOKEN_ID = (1 << 31) - 1  # a real tokenizer's id: int32, as every vocabulary fits
SYNTHETIC_ID_LIMIT = 1 << 40
"""Every synthetic token id of a Mooncake block (``hash_id * 512 + i``) is below this."""
MAX_HASH_ID = SYNTHETIC_ID_LIMIT // MOONCAKE_BLOCK_TOKENS - 1

TraceSource = str | Path

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_REQUEST_TOKENS)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_REQUEST_TOKENS)]
Id = Annotated[int, msgspec.Meta(ge=0)]
Millis = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
Token = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
HashId = Annotated[int, msgspec.Meta(ge=0, le=MAX_HASH_ID)]


class _MooncakeRow(msgspec.Struct):
    timestamp: Millis
    input_length: Positive
    output_length: Count
    hash_ids: list[HashId]


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
    user_ids: list[Token]
    output_ids: list[Token]


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
    radix = _check_rows(path, "radix", data["radix"]["requests"], _RadixRow)
    prompts = data["radix"]["system_prompts"]
    if not isinstance(prompts, list) or not prompts:
        raise TraceError(f"{path}: radix system_prompts must be a list of non-empty token lists")
    for i, prompt in enumerate(prompts):
        try:
            msgspec.convert(prompt, type=_Prompt)
        except msgspec.ValidationError as exc:
            raise TraceError(f"{path}: radix system_prompts[{i}]: {exc} (a non-empty list of token ids)") from None
    for i, row in enumerate(radix):
        if row.sys_id >= len(prompts):
            raise TraceError(
                f"{path}: radix request {i} (rid {row.rid}): field sys_id {row.sys_id} names no system prompt; "
                f"the trace has {len(prompts)} (0..{len(prompts) - 1})"
            )
    return data


_Prompt = Annotated[list[Token], msgspec.Meta(min_length=1)]


def _check_rows(path: TraceSource, part: str, rows: object, schema: type[msgspec.Struct]) -> list[Any]:
    """``rows`` converted to ``schema``; a bad row is named by its position and ``rid``."""
    if not isinstance(rows, list):
        raise TraceError(f"{path}: {part} requests must be a list of objects, not {type(rows).__name__}")
    try:
        checked: list[Any] = msgspec.convert(rows, type=list[schema])  # type: ignore[valid-type]
    except msgspec.ValidationError:
        for i, row in enumerate(rows):  # find the row to name (only on failure: the whole list converts fast)
            try:
                msgspec.convert(row, type=schema)
            except msgspec.ValidationError as exc:
                rid = row.get("rid") if isinstance(row, dict) else None
                raise TraceError(f"{path}: {part} request {i} (rid {rid}): {exc}") from None
        raise
    ids = [row.rid for row in checked]
    if len(set(ids)) != len(ids):
        dup = next(r for i, r in enumerate(ids) if r in ids[:i])
        raise TraceError(f"{path}: {part} request id {dup} appears more than once")
    return checked


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
