"""Argument checks shared by the memory's calls: host ids, counts, id ranges, bounded lookups.

Invariants:
- Counts, lengths and positions are ints >= 0 (``bool`` and floats refused), checked before
  anything is reserved (a float would otherwise fail only after slabs were acquired).
- Ids outside a table are refused, never wrapped: a negative id would otherwise read another
  request's entries from the end of the table.
- Ids given as host arrays are checked on the host. Ids given as tensors are never read back:
  ``select`` looks them up with a bounds-checked ``index_select``, which refuses an
  out-of-range or negative id where the table lives (``InvalidIds`` for a CPU table; a
  device-side assert, which stops the process, for a GPU table). So device ids are trusted
  to be in range, and a bad one fails loudly instead of aliasing.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.memory.errors import InvalidIds

EMPTY = np.empty(0, dtype=np.int64)

IdsLike = np.ndarray | list[int] | torch.Tensor


def host_ids(ids: IdsLike | np.ndarray, what: str) -> np.ndarray:
    """Accept host ids only: a device tensor here would need a blocking read."""
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
        return ids
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise TypeError(
                f"{what}: pass host ids (numpy or CPU); reading a {ids.device} tensor would "
                "block the host on the device"
            )
        ids = ids.numpy()
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidIds(f"{what}: ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)


def count_arg(value: object, what: str) -> int:
    """A count (or length, position) argument: a Python or numpy integer >= 0.

    Checked before anything is reserved: a float or bool would otherwise fail only after
    slabs were acquired for it.
    """
    if type(value) is int and value >= 0:  # the common case, first
        return value
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise InvalidIds(f"{what} must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise InvalidIds(f"{what} must be >= 0, got {value}")
    return int(value)


def out_of_range(bad: np.ndarray, limit: int, what: str, noun: str) -> InvalidIds:
    shown = ", ".join(str(int(i)) for i in bad[:5]) + (f", ... ({bad.size} in all)" if bad.size > 5 else "")
    return InvalidIds(f"{what}: {noun} [{shown}] outside the valid range 0..{limit - 1}")


def check_range(ids: np.ndarray, limit: int, what: str, noun: str) -> None:
    """Host ids must lie in ``[0, limit)``: a negative id would index from the end of a
    table (another request's entries), a large one past it."""
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        raise out_of_range(ids[(ids < 0) | (ids >= limit)], limit, what, noun)


def select(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` where every index is bounds-checked, negatives included (plain
    indexing would wrap a negative id to the end of the table). The check runs where the
    table lives: a CPU table raises ``IndexError`` at once; on a GPU an out-of-range id is a
    device-side assert (the process stops; it never reads another request's entries)."""
    if index.dim() == 1:
        return table.index_select(0, index)
    return table.index_select(0, index.reshape(-1)).view(index.shape)


def bad_tensor_ids(ids: torch.Tensor, limit: int, what: str, noun: str) -> InvalidIds:
    """The error for tensor ids a CPU table refused (the ids are host memory: reading them
    on this error path blocks nothing)."""
    flat = ids.reshape(-1)
    return out_of_range(flat[(flat < 0) | (flat >= limit)].numpy(), limit, what, noun)
