"""Real request traces shipped inside the package (``hybridkv/traces/data/``), and their loaders.

- ``peer_trace.json.gz``: deterministic allocator / prefix-cache replay trace with exact
  call protocols (``alloc`` and ``radix`` parts); see ``traces/data/README.md``.
- ``mooncake_conversation_trace.jsonl.gz``: the conversation workload of the public
  Mooncake FAST'25 trace (Kimi production service, Apache-2.0): arrival time, input and
  output lengths, and prefix-block hashes of 512 tokens.

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
from typing import Any

import numpy as np

_DATA = resources.files("hybridkv.traces").joinpath("data")
PEER_TRACE = "peer"
MOONCAKE_TRACE = "mooncake-conversation"
TRACES: dict[str, Traversable] = {
    PEER_TRACE: _DATA.joinpath("peer_trace.json.gz"),
    MOONCAKE_TRACE: _DATA.joinpath("mooncake_conversation_trace.jsonl.gz"),
}
MOONCAKE_BLOCK_TOKENS = 512

TraceSource = str | Path


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
    data = json.loads(_open_text(path))
    for part, keys in (
        ("alloc", ("requests", "events", "peak_live_pages")),
        ("radix", ("system_prompts", "requests")),
    ):
        if part not in data or any(k not in data[part] for k in keys):
            raise TraceError(f"{path}: expected a {part!r} section with {keys}")
    return data


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


def load_mooncake_trace(path: TraceSource = MOONCAKE_TRACE, limit: int | None = None) -> list[MooncakeRequest]:
    out = []
    for lineno, line in enumerate(_open_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            req = MooncakeRequest(
                int(row["timestamp"]),
                int(row["input_length"]),
                int(row["output_length"]),
                tuple(row["hash_ids"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{path}:{lineno}: bad request record ({exc})") from exc
        if req.input_length > len(req.hash_ids) * MOONCAKE_BLOCK_TOKENS:
            raise TraceError(f"{path}:{lineno}: input_length {req.input_length} exceeds {len(req.hash_ids)} blocks")
        out.append(req)
        if limit is not None and len(out) >= limit:
            break
    return out
