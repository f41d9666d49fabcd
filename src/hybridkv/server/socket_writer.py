"""SocketWriter: a stream's chunks written to its connection by the thread that made them, not by the event loop.

A streamed token handed to the event loop costs a wake-up of the loop thread, which then takes the GIL
from the engine thread and gives it back: measured, about 0.2-0.3 ms per chunk on 2 shared cores, most of it
thread switching. So, for a stream whose response uvicorn has started (head written, chunked), the
backend's thread writes each chunk itself, framed as HTTP/1.1 chunked encoding (length, CRLF, data,
CRLF), with one non-blocking ``send(2)`` that keeps the GIL; the last chunk too. The loop is woken only
to end the response through uvicorn's ``send`` (its terminator; so uvicorn's response state stays its own).

Invariants:
- Used only on a plain-TCP connection of uvicorn's HTTP/1.1 protocol whose response is chunked and has
  nothing left in the transport's buffer after the head (``attach`` answers ``None`` otherwise, and the
  stream is written by the loop as before). No TLS: a TLS transport is never written to directly.
- Bytes reach the connection in the order written. A chunk the socket does not take whole (a slow
  client: its buffer full) is spilled: its remainder, and anything written after it, goes to the loop's
  transport (``flush``, in the loop), never directly again; ``write`` answers False so that the caller
  hands the rest of the stream to the loop, which writes it through uvicorn's ``send`` (its flow control:
  waiting for the client, the tokens meanwhile merged into one chunk) after flushing.
- A connection error other than a full buffer (the peer gone, or the kernel refusing) is never silent:
  the writer is ``broken``, drops the rest, and the loop aborts the connection (the stream's watcher then
  aborts the request), so a client never gets a well-formed answer with chunks missing.
- The socket is written through a duplicate descriptor owned here, so the connection's number being
  reused after uvicorn closes it can never send a chunk to another client. ``close`` (once, in the loop)
  closes it under the lock; later writes are dropped. ``send`` never blocks (``MSG_DONTWAIT``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import socket
import threading
from typing import Any

from starlette.types import Send

_libc = ctypes.PyDLL(None, use_errno=True)
_send = _libc.send
"""send(2) called without releasing the GIL (``PyDLL``): releasing it lets the loop thread take it in the middle of
the engine thread's write, which then waits to get it back."""
_send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
_send.restype = ctypes.c_ssize_t
_fcntl = _libc.fcntl
"""fcntl(2) (a close-on-exec duplicate, as ``os.dup`` makes) and close(2) keep the GIL too: in the loop, while the
engine thread computes, releasing it stalls the loop until that thread lets the GIL go (measured: about 2 ms a stream
for ``os.dup``) and forces that thread to switch."""
_fcntl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
_fcntl.restype = ctypes.c_int
_close = _libc.close
_close.argtypes = [ctypes.c_int]
_close.restype = ctypes.c_int
_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0) | socket.MSG_DONTWAIT
_RETRY = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)


def connection_closed(send: Send) -> bool:
    """The connection behind uvicorn's ``send`` is closed or closing (False where that is not known); its request
    is then marked disconnected, as uvicorn marks only the newest request of a connection.

    A request's own ``receive`` is not enough to learn it: a client that pipelined a second request and then went
    away leaves the first one waiting for a disconnect that never comes, and its next ``send`` would raise on the
    closed transport. Marked, its ``send`` drops what it gets, its ``receive`` answers ``http.disconnect`` (the
    stream's watcher aborts it) and uvicorn logs no error for its unfinished response."""
    cycle: Any = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None or not hasattr(transport, "is_closing") or not transport.is_closing():
        return False
    if getattr(cycle, "disconnected", True) is False and not getattr(cycle, "response_complete", True):
        cycle.disconnected = True
        event = getattr(cycle, "message_event", None)
        if event is not None:
            event.set()
    return True


def chunk_frame(body: bytes) -> bytes:
    """``body`` as one chunk of HTTP/1.1 chunked transfer encoding."""
    return b"%x\r\n%b\r\n" % (len(body), body)


class SocketWriter:
    def __init__(self, fd: int, transport: Any, loop: asyncio.AbstractEventLoop):
        """``transport``: uvicorn's, an asyncio transport (uvloop's is not an ``asyncio.Transport`` subclass)."""
        self._fd: int | None = fd
        self._transport = transport
        self._loop = loop
        self._lock = threading.Lock()
        self._spill: list[bytes] = []  # framed bytes for the loop's transport, in order (under _lock)
        self._spilling = False  # a chunk was not taken whole: every later byte goes through the loop
        self.broken = False  # the connection failed: the rest is dropped, the loop aborts it

    @classmethod
    def attach(cls, send: Send) -> SocketWriter | None:
        """In the loop, right after the response's head went through uvicorn's ``send``: a writer for its
        body, or ``None`` where writing directly is not safe (another server, TLS, not chunked, bytes
        still buffered)."""
        cycle: Any = getattr(send, "__self__", None)
        transport: Any = getattr(cycle, "transport", None)
        if not hasattr(transport, "get_write_buffer_size") or not getattr(cycle, "chunked_encoding", False):
            return None
        if transport.get_extra_info("sslcontext") is not None or transport.is_closing():
            return None
        sock = transport.get_extra_info("socket")
        if sock is None or transport.get_write_buffer_size() != 0:
            return None
        fd = _fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, 0)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "dup of a connection's socket failed")
        return cls(fd, transport, asyncio.get_running_loop())

    def write(self, body: bytes) -> bool:
        """Any thread: ``body`` as the next chunk of the response. True: sent whole, the next may come here too;
        False: hand the rest of the stream to the loop (this chunk spilled, or the connection failed)."""
        if not body:  # an empty chunk would be the chunked encoding's terminator
            return True
        frame = chunk_frame(body)
        then = None
        with self._lock:
            if self._fd is None or self.broken:
                return False
            if not self._spilling:
                if self._transport.is_closing():  # uvicorn closed the connection (the socket lives on in our fd)
                    self.broken = True
                    return False
                sent = _send(self._fd, frame, len(frame), _FLAGS)
                if sent == len(frame):
                    return True
                if sent < 0 and ctypes.get_errno() not in _RETRY:
                    self.broken = True
                    then = self._transport.abort
                else:
                    frame = frame[max(sent, 0) :]
                    self._spilling = True
            if then is None:
                self._spill.append(frame)
                then = self.flush if len(self._spill) == 1 else None
        if then is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads this stream any more
                self._loop.call_soon_threadsafe(then)
        return False

    @property
    def spilling(self) -> bool:
        return self._spilling

    def flush(self) -> None:
        """In the loop: the spilled bytes to the transport (it sends them as the client reads); a broken
        connection aborted now (``connection_closed`` then knows)."""
        with self._lock:
            data, self._spill = b"".join(self._spill), []
        if self.broken:
            self._transport.abort()
        elif data and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        """In the loop, once the stream is over: the duplicate descriptor closed; later writes dropped."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            _close(fd)
