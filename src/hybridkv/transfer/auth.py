"""Authenticated control-plane frames: a cluster key, a MAC on every message, no replays.

Every control message travels as one frame ``MAC (32 B) || msgpack(Envelope)``. The MAC
is keyed BLAKE2b over the envelope's exact bytes with the cluster key the operator
provides (``load_cluster_key``: ``HYBRIDKV_CLUSTER_KEY`` or a key file named by
``HYBRIDKV_CLUSTER_KEY_FILE``, both hex). The envelope names its sender (a ``Rank``), the sender's
*epoch* (its incarnation: nanoseconds since the epoch when the process's agent started),
a per-sender sequence number and the receiver (``to``) besides the message itself.

Invariants:
- ``Gate.open`` checks the MAC before it decodes a byte; a frame with a wrong, missing or
  truncated MAC raises ``AuthError`` and changes no state.
- Per sender, (epoch, seq) only grows: a frame with an older epoch, or the same epoch and
  a sequence number not above the last accepted one, is a replay and is refused. A frame
  addressed to another receiver is refused (a capture cannot be replayed elsewhere).
- Replay state is only updated by a frame that passed every check; a refused frame
  changes nothing.
- The key is never logged or sent; ``repr`` hides it.
- A key is at least ``MIN_KEY_BYTES`` bytes with some entropy (``ClusterKey`` refuses a key of
  fewer than ``MIN_DISTINCT_BYTES`` distinct byte values or one that repeats a shorter block):
  the variable and the file give it in one format, hex. A key file is read only if it is a
  regular file (never a FIFO or device: opened non-blocking, not following a symlink, checked
  with ``fstat``), no larger than ``MAX_KEY_FILE_BYTES``, and readable by its owner alone.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import stat
import time
from collections.abc import Callable

import msgspec

from hybridkv.transfer.errors import ProtocolError, TransferError
from hybridkv.transfer.messages import Message, Rank

KEY_ENV = "HYBRIDKV_CLUSTER_KEY"
KEY_FILE_ENV = "HYBRIDKV_CLUSTER_KEY_FILE"
MIN_KEY_BYTES = 16
MIN_DISTINCT_BYTES = 8  # 16 random bytes have fewer than 8 distinct values with probability < 1e-16
MAX_KEY_FILE_BYTES = 4096
MAC_BYTES = 32
_MAKE_KEY = "generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`"


class AuthError(ProtocolError):
    """A frame without a valid MAC, replayed, or addressed to someone else."""


class ClusterKey:
    """The shared secret of one cluster (at least ``MIN_KEY_BYTES`` random bytes)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise TransferError(f"a cluster key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}; {_MAKE_KEY}")
        weak = _weakness(bytes(key))
        if weak:
            raise TransferError(f"the cluster key has too little entropy ({weak}); {_MAKE_KEY}")
        self._key = bytes(key[:64])  # BLAKE2b takes keys of up to 64 bytes

    @classmethod
    def generate(cls) -> ClusterKey:
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_hex(cls, text: str, where: str) -> ClusterKey:
        """The key written as hex digits (surrounding whitespace ignored); ``TransferError`` naming ``where``."""
        try:
            key = bytes.fromhex(text.strip())
        except ValueError:
            raise TransferError(
                f"{where}: the cluster key must be hex digits (an even number of 0-9a-f); {_MAKE_KEY}"
            ) from None
        try:
            return cls(key)
        except TransferError as exc:
            raise TransferError(f"{where}: {exc}") from None

    @property
    def hex(self) -> str:
        """The key as hex, to hand to a child process's environment (never log it)."""
        return self._key.hex()

    def mac(self, data: bytes) -> bytes:
        return hashlib.blake2b(data, key=self._key, digest_size=MAC_BYTES).digest()

    def __repr__(self) -> str:
        return "ClusterKey(<hidden>)"


def _weakness(key: bytes) -> str:
    """Why ``key`` is too predictable to be a cluster key ("" when it is not)."""
    distinct = len(set(key))
    if distinct < MIN_DISTINCT_BYTES:
        return f"{distinct} distinct byte values in {len(key)} bytes, want at least {MIN_DISTINCT_BYTES}"
    for period in range(1, MIN_KEY_BYTES + 1):
        if period < len(key) and all(key[i] == key[i - period] for i in range(period, len(key))):
            return f"it repeats a block of {period} bytes"
    return ""


def read_key_file(path: str) -> str:
    """The text of key file ``path``: a regular file (not a FIFO, device or symlink), at most
    ``MAX_KEY_FILE_BYTES``, with no permission for group or others; never blocks."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if os.path.islink(path):
            raise TransferError(
                f"the cluster key file {path} is a symbolic link; name the file itself ({os.path.realpath(path)})"
            ) from None
        raise TransferError(f"cannot read the cluster key file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TransferError(
                f"the cluster key file {path} is not a regular file (a FIFO, device or directory); "
                "write the key as hex into a file"
            )
        if info.st_mode & 0o077:
            raise TransferError(
                f"the cluster key file {path} is readable by others (mode {stat.filemode(info.st_mode)}); "
                f"run `chmod 600 {path}`"
            )
        if info.st_size > MAX_KEY_FILE_BYTES:
            raise TransferError(
                f"the cluster key file {path} is larger than {MAX_KEY_FILE_BYTES // 1024} KiB "
                f"({info.st_size} B); it holds one hex key"
            )
        data = b""
        while len(data) <= MAX_KEY_FILE_BYTES:  # bounded even if the file grew since fstat
            chunk = os.read(fd, MAX_KEY_FILE_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise TransferError(f"cannot read the cluster key file {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise TransferError(f"the cluster key file {path} is larger than {MAX_KEY_FILE_BYTES // 1024} KiB")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise TransferError(f"cluster key file {path}: the cluster key must be hex digits; {_MAKE_KEY}") from None


def load_cluster_key(path: str | None = None) -> ClusterKey:
    """The cluster key from ``path``, else ``$HYBRIDKV_CLUSTER_KEY_FILE``, else
    ``$HYBRIDKV_CLUSTER_KEY``, hex in each case; ``TransferError`` saying how to provide one otherwise."""
    path = path or os.environ.get(KEY_FILE_ENV)
    if path:
        return ClusterKey.from_hex(read_key_file(path), f"cluster key file {path}")
    text = os.environ.get(KEY_ENV)
    if text:
        return ClusterKey.from_hex(text, f"${KEY_ENV}")
    raise TransferError(
        f"no cluster key: set ${KEY_ENV} (hex) or ${KEY_FILE_ENV} (a file holding it, mode 600), or pass key=; "
        "every rank of a cluster must use the same key"
    )


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    sender: Rank
    epoch: int
    seq: int
    to: str
    body: Message


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def new_epoch() -> int:
    """A sender's incarnation: grows across restarts of a rank (wall clock, ns)."""
    return time.time_ns()


class Seal:
    """Signs what one sender sends: its rank, its epoch, a sequence number that only grows."""

    def __init__(self, key: ClusterKey, sender: Rank, epoch: int | None = None) -> None:
        self.key, self.sender = key, sender
        self.epoch = new_epoch() if epoch is None else epoch
        self._seq = itertools.count(1)  # next() is atomic: any thread may seal

    def seal(self, to: str, msg: Message) -> bytes:
        """The frame of ``msg`` for receiver ``to``."""
        return self.frame(to, msg)[1]

    def frame(self, to: str, msg: Message) -> tuple[int, bytes]:
        """(its sequence number, the frame of ``msg`` for receiver ``to``)."""
        seq = next(self._seq)
        data = _encoder.encode(Envelope(self.sender, self.epoch, seq, to, msg))
        return seq, self.key.mac(data) + data


class Gate:
    """Opens frames for one receiver: MAC, addressee, then replay state per sender."""

    def __init__(self, key: ClusterKey) -> None:
        self.key = key
        self._last: dict[Rank, tuple[int, int]] = {}  # sender -> (epoch, seq) last accepted

    def open(self, data: bytes, to: str | Callable[[str], bool]) -> Envelope:
        mac, body = data[:MAC_BYTES], data[MAC_BYTES:]
        if len(data) <= MAC_BYTES or not hmac.compare_digest(mac, self.key.mac(body)):
            raise AuthError(f"frame of {len(data)} B without a valid MAC (no key, or another cluster's key)")
        try:
            env = _decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"malformed message ({len(body)} B) from a key holder: {exc}") from None
        if not (to(env.to) if callable(to) else env.to == to):
            raise AuthError(f"frame from {env.sender} addressed to {env.to!r}, not to this receiver")
        last = self._last.get(env.sender)
        if last is not None and (env.epoch, env.seq) <= last:
            what = "an older epoch" if env.epoch < last[0] else f"sequence {env.seq} <= {last[1]}"
            raise AuthError(f"replayed or stale frame from {env.sender}: {what}")
        self._last[env.sender] = (env.epoch, env.seq)
        return env
