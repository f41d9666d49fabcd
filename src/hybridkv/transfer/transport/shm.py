"""Shared-memory copy transport: one host, the writer maps the peer's ``/dev/shm`` arena.

The receiving side owns a ``SharedBuffer``; its session is ``shm:<token>:<addr>:<nbytes>``
(the arena's token, and where the arena sits in the receiver's address space). The writer
maps the file once and turns each destination address into an offset in its own mapping.

Invariants:
- A session names a token, never a path: the writer only ever opens
  ``/dev/shm/hybridkv-<token>``, without following links, and maps it only after its
  owner, size and header check out (``shared.open_shared``). ``check_session`` refuses
  any other session before anything is opened.
- ``submit`` copies synchronously: the handle it returns has already ended (done).
- Every destination range must lie inside the peer's buffer and every source range inside
  a region this side registered; otherwise ``submit`` raises and copies nothing. The check
  reads the caller's ``bounds`` when given (a plan's, from its checked cell ids), else
  reduces the op arrays.
- Large ops are one ``memmove`` each, straight from the plan's lists; small ops (TP head
  slices) are gathered and scattered with vectorized numpy indexing, grouped by length. A
  small plan (ops as lists, every op large, bounds inside the peer's buffer and the first
  registered region) is copied by the bare ``memmove`` loop, with no array made: its checks
  are the same comparisons of the bounds, done first.
"""

from __future__ import annotations

import ctypes

import numpy as np

from hybridkv.transfer.errors import TransportError
from hybridkv.transfer.ops import Bounds, Ops, as_ints
from hybridkv.transfer.shared import SharedBuffer, open_shared, shm_path
from hybridkv.transfer.transport.base import DONE, BenchGoal, Transport, TransportName, WriteHandle

SMALL_OP = 2048  # bytes; smaller ops are copied in vectorized batches
_BATCH_BYTES = 1 << 24  # index memory bound for one vectorized batch


def parse_session(session: str) -> tuple[str, int, int]:
    """(token, arena address in the peer, arena bytes) of a shm session; ``TransportError``
    for anything else (a path, a negative or absurd size)."""
    try:
        scheme, token, addr, nbytes = session.split(":")
        remote, size = int(addr, 16), int(nbytes)
        if scheme != "shm" or remote <= 0 or not 0 < size < 1 << 48:
            raise ValueError(session)
        shm_path(token)  # refuses a token that is not hybridkv's: a path, '..', anything else
    except (ValueError, TransportError):
        raise TransportError(f"not a shm session: {session!r} (want shm:<token>:<hex addr>:<bytes>)") from None
    return token, remote, size


class _Mapping:
    def __init__(self, session: str) -> None:
        token, self.remote, self.nbytes = parse_session(session)
        self.mm, offset = open_shared(token, self.nbytes)
        self.array = np.frombuffer(self.mm, dtype=np.uint8, count=self.nbytes, offset=offset)
        self.base = self.array.ctypes.data
        self.end = self.remote + self.nbytes  # the peer's buffer is [remote, end) in the peer
        self.shift = self.base - self.remote  # peer address -> address in this process's mapping

    def close(self) -> None:
        del self.array
        self.mm.close()


class ShmTransport(Transport):
    name = TransportName.SHM
    max_ops_per_submit = 1 << 16
    shared_arena = True
    cross_process = True  # any process of this host maps the peer's arena
    bench_goal = BenchGoal("raw memcpy of the same ops", 0.8, from_page_bytes=64 << 10, copy_bound=True)

    def __init__(self, shared: SharedBuffer | None = None) -> None:
        """``shared``: this side's buffer that peers may write into (decode side)."""
        self._shared = shared
        self._local: list[tuple[int, np.ndarray]] = []
        self._first = (0, 0)  # the first registered region's [start, end): the bounds' usual home
        self._peers: dict[str, _Mapping] = {}

    @classmethod
    def create(cls, shared: SharedBuffer | None = None, **options: object) -> ShmTransport:
        if options:
            raise TypeError(f"the shm transport takes no options, got {sorted(options)}")
        return cls(shared)

    @property
    def session(self) -> str:
        if self._shared is None:
            return ""
        return f"shm:{self._shared.token}:{self._shared.addr:x}:{self._shared.nbytes}"

    def check_session(self, session: str) -> None:
        parse_session(session)

    def register(self, addr: int, length: int) -> None:
        array = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))
        self._local.append((addr, array))
        if len(self._local) == 1:
            self._first = (addr, addr + length)

    def submit(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None = None) -> WriteHandle:
        self._copy(peer, src, dst, length, bounds)
        return WriteHandle(peer, len(src), DONE)

    def _copy(self, peer: str, src: Ops, dst: Ops, length: Ops, bounds: Bounds | None) -> None:
        if not len(src):
            return
        target = self._peers.get(peer) or self._map(peer)
        if bounds is None:
            bounds = _bounds(np.asarray(src), np.asarray(dst), np.asarray(length))
        src_lo, src_hi, dst_lo, dst_hi, min_len = bounds
        local_lo, local_hi = self._first
        if (
            type(src) is type(dst) is type(length) is list
            and min_len >= SMALL_OP
            and target.remote <= dst_lo
            and dst_hi <= target.end
            and local_lo <= src_lo
            and src_hi <= local_hi
        ):  # the common case (a small plan's lists, every op one memmove, both bounds proven): no arrays
            shift = target.shift
            for s, d, n in zip(src, dst, length, strict=True):
                ctypes.memmove(d + shift, s, n)
            return
        if dst_lo < target.remote or dst_hi > target.end:
            dst, length = np.asarray(dst), np.asarray(length)
            end = dst + length
            i = int(np.argmax((dst < target.remote) | (end > target.remote + target.nbytes)))
            raise TransportError(
                f"shm write to {peer}: destination [{dst[i]:#x}, {end[i]:#x}) is outside the peer's buffer"
            )
        region = self._regions(src, length, bounds)
        shift = target.shift
        if min_len >= SMALL_OP:  # the common case: every op is one memmove
            for s, d, n in zip(as_ints(src), as_ints(dst), as_ints(length), strict=True):
                ctypes.memmove(d + shift, s, n)
            return
        src, dst, length = np.asarray(src), np.asarray(dst), np.asarray(length)
        big = length >= SMALL_OP
        for s, d, n in zip(src[big].tolist(), dst[big].tolist(), length[big].tolist(), strict=True):
            ctypes.memmove(d + shift, s, n)
        off, small = dst - target.remote, ~big
        if region is None:
            addr, array = self._local[0]
            _scatter(target.array, off[small], array, src[small] - addr, length[small])
            return
        for k, (addr, array) in enumerate(self._local):
            pick = small & (region == k)
            if pick.any():
                _scatter(target.array, off[pick], array, src[pick] - addr, length[pick])

    def raw_write(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> None:
        """One ``memmove`` per op into this side's mapping of the peer's arena (the one ``submit`` writes
        through: a second mapping of the same pages, as a prefill process has)."""
        shift = (self._peers.get(peer) or self._map(peer)).shift
        for s, d, n in zip(src, dst, length, strict=True):
            ctypes.memmove(d + shift, s, n)

    def _map(self, peer: str) -> _Mapping:
        self._peers[peer] = _Mapping(peer)
        return self._peers[peer]

    def _regions(self, src: Ops, length: Ops, bounds: Bounds) -> np.ndarray | None:
        """Index of the registered local region holding each source range; None when the
        bounds lie in the first region (the common case)."""
        if self._local:
            addr, array = self._local[0]
            if addr <= bounds.src_lo and bounds.src_hi <= addr + array.size:
                return None
        src, length = np.asarray(src), np.asarray(length)
        region = np.full(src.size, -1, dtype=np.int64)
        for k, (addr, array) in enumerate(self._local):
            region[(src >= addr) & (src + length <= addr + array.size)] = k
        if (region < 0).any():
            i = int(np.argmax(region < 0))
            raise TransportError(
                f"shm write: source [{src[i]:#x}, {src[i] + length[i]:#x}) is outside every registered local region"
            )
        return region

    def close(self) -> None:
        for mapping in self._peers.values():
            mapping.close()
        self._peers.clear()
        self._local.clear()


def _bounds(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Bounds:
    end_src, end_dst = src + length, dst + length
    return Bounds(int(src.min()), int(end_src.max()), int(dst.min()), int(end_dst.max()), int(length.min()))


def _scatter(dst: np.ndarray, dst_off: np.ndarray, src: np.ndarray, src_off: np.ndarray, length: np.ndarray) -> None:
    """``dst[dst_off[i]:+length[i]] = src[src_off[i]:+length[i]]`` for small ops, vectorized."""
    for n in np.unique(length).tolist():
        same = np.flatnonzero(length == n)
        step = max(1, _BATCH_BYTES // n)
        idx = np.arange(n, dtype=np.int64)
        for i in range(0, same.size, step):
            pick = same[i : i + step]
            dst[(dst_off[pick, None] + idx).ravel()] = src[(src_off[pick, None] + idx).ravel()]
