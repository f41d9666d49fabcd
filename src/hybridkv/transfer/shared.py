"""Shared-memory arenas: a decode memory whose bytes other processes on the host can map.

The arena buffer is a file ``/dev/shm/hybridkv-<token>`` (``token``: 32 random hex digits)
mapped ``MAP_SHARED`` (``torch.from_file``) and handed to ``UnifiedMemory`` through its
``buffer`` argument; a writer maps the same file and sees the same bytes. The file starts
with a ``HEADER_BYTES`` header (magic, arena size, owner token, owner pid); the arena
follows it, page aligned.

Invariants:
- Only files named ``hybridkv-<token>`` directly in ``/dev/shm`` are ever created or
  opened (``shm_path`` refuses any other name), created exclusively with mode 0600 and
  opened without following links (``open_shared``: a regular file owned by this user,
  of exactly header + size bytes, whose header names the same size and token); anything
  else is refused before a byte is mapped.
- The file is unlinked when the owner closes it (or is garbage collected). A peer that
  mapped it keeps a valid mapping until it unmaps it, so a decode shutdown never faults
  a writer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
import struct
import weakref

import torch

from hybridkv.memory import MemoryHints, UnifiedMemory, parse_bytes, plan_memory
from hybridkv.spec import ShardSpec
from hybridkv.transfer.errors import TransportError

SHM_DIR = "/dev/shm"
PREFIX = "hybridkv-"
HEADER_BYTES = 4096
MAGIC = b"hybridkv-shm-v1\x00"
_HEADER = struct.Struct("<16sQ16sQ")  # magic, arena bytes, owner token, owner pid
_TOKEN = re.compile(r"[0-9a-f]{32}")


def shm_path(token: str) -> str:
    """The path of the shared arena ``token``; ``TransportError`` for any other token."""
    if not _TOKEN.fullmatch(token):
        raise TransportError(f"{token!r} is not a hybridkv shared-memory token (32 hex digits)")
    return os.path.join(SHM_DIR, PREFIX + token)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedBuffer:
    """A ``/dev/shm`` arena of ``nbytes`` bytes behind a checked header, mapped as one uint8 tensor."""

    def __init__(self, nbytes: int, token: str | None = None) -> None:
        """``token``: the arena's name, chosen by whoever must be able to unlink the file even if this
        process dies before it reports it (32 random hex digits; default: fresh ones)."""
        if nbytes <= 0:
            raise ValueError(f"shared buffer needs a positive size, got {nbytes}")
        self.nbytes = nbytes
        self.token = token or secrets.token_hex(16)
        self.path = shm_path(self.token)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + nbytes)
            os.pwrite(fd, _HEADER.pack(MAGIC, nbytes, bytes.fromhex(self.token), os.getpid()), 0)
        except BaseException:
            os.close(fd)
            _unlink(self.path)
            raise
        os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        whole = torch.from_file(self.path, shared=True, size=HEADER_BYTES + nbytes, dtype=torch.uint8)
        self.tensor = whole[HEADER_BYTES:]

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()

    def close(self) -> None:
        """Unlink the file; this process's mapping lives until the tensor is dropped."""
        self._finalizer()


def open_shared(token: str, nbytes: int) -> tuple[mmap.mmap, int]:
    """Map the arena ``token`` of ``nbytes`` bytes written by a peer: (the mapping of the
    whole file, where the arena starts in it). Refuses (``TransportError``) a link, a
    non-regular file, another user's file, a wrong size or a header that does not match."""
    path = shm_path(token)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise TransportError(f"cannot open shm peer {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise TransportError(f"shm peer {path} is not a regular file owned by uid {os.getuid()}")
        if st.st_size != HEADER_BYTES + nbytes:
            raise TransportError(
                f"shm peer {path}: file has {st.st_size} B, the session says {HEADER_BYTES} + {nbytes} B"
            )
        magic, size, owner, _ = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
        if magic != MAGIC or size != nbytes or owner != bytes.fromhex(token):
            raise TransportError(f"shm peer {path}: header does not describe a hybridkv arena of {nbytes} B")
        return mmap.mmap(fd, HEADER_BYTES + nbytes), HEADER_BYTES
    except OSError as exc:
        raise TransportError(f"cannot map shm peer {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def shared_memory(
    shard: ShardSpec, budget: int | str, token: str | None = None, **hints: object
) -> tuple[UnifiedMemory, SharedBuffer]:
    """A CPU ``UnifiedMemory`` whose arena lives in a ``SharedBuffer`` (named ``token`` when given)."""
    plan = plan_memory(shard, parse_bytes(budget), MemoryHints(**hints))  # type: ignore[arg-type]
    shared = SharedBuffer(plan.budget_bytes, token)
    return UnifiedMemory(plan, "cpu", buffer=shared.tensor), shared
