"""The header of a ``*.safetensors`` file, read and checked without reading any tensor data.

Format: an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data region; offsets are relative to it.

Invariants (``read_header``): a file that is not safetensors (too short, a header length beyond
``MAX_HEADER_BYTES`` or the file, a header that is not a JSON object of such entries), a dtype
torch cannot load, an entry whose byte range disagrees with its shape and dtype, entries that
overlap or leave gaps, and a file whose data region is shorter than the entries declare
(truncated) each raise ``WeightError`` naming the file (and the tensor). Reads at most
``8 + N`` bytes.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.engine.errors import WeightError

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int

    def meta(self) -> torch.Tensor:
        """A tensor of this shape and dtype with no data (for checking shapes)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def _entry(path: Path, name: str, entry: Any) -> tuple[TensorInfo, int, int]:
    bad = WeightError(f"{path}: not a safetensors file (entry {name!r} is not {{dtype, shape, data_offsets}})")
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise bad
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    ints = [*shape, *offsets] if isinstance(shape, list) and isinstance(offsets, list) else None
    if ints is None or len(offsets) != 2 or not all(isinstance(v, int) and v >= 0 for v in ints):
        raise bad
    if dtype not in DTYPES:
        raise WeightError(f"{path}: tensor {name} has dtype {dtype!r}, which torch cannot load; known: {list(DTYPES)}")
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise WeightError(
            f"{path}: tensor {name} declares {dtype} {tuple(shape)} ({nbytes} B) over bytes [{begin}, {end}) of the "
            "data; the file is corrupt"
        )
    return TensorInfo(DTYPES[dtype], tuple(shape), nbytes), begin, end


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """``{tensor name: TensorInfo}`` of safetensors file ``path``, checked (see the module doc)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > MAX_HEADER_BYTES:
                raise WeightError(f"{path}: not a safetensors file (no valid header length in its first 8 bytes)")
            if 8 + length > size:
                raise WeightError(f"{path}: truncated: its header alone is {length} B, the file {size} B")
            raw = f.read(length)
    except OSError as exc:
        raise WeightError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise WeightError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise WeightError(f"{path}: not a safetensors file (its header is not a JSON object)")
    entries = sorted(
        ((name, *_entry(path, name, entry)) for name, entry in header.items() if name != "__metadata__"),
        key=lambda e: (e[2], e[3]),
    )
    data = size - 8 - length
    end = 0
    for i, (name, _, begin, stop) in enumerate(entries):
        if begin != end:
            what = f"overlap with {entries[i - 1][0]}" if begin < end else f"start {begin - end} B after the previous"
            raise WeightError(f"{path}: not a safetensors file (the bytes of tensor {name} {what})")
        end = stop
    if end > data:
        last = entries[-1][0]
        raise WeightError(
            f"{path}: truncated: its tensors need {end} B of data (up to {last}), the file holds {data} B; "
            "download or copy it again"
        )
    if end < data:
        raise WeightError(f"{path}: not a safetensors file ({data - end} B of data after the last tensor)")
    return {name: info for name, info, _, _ in entries}
