"""SocketWriter over a real socket pair whose write end is an asyncio transport (uvloop's, as the server's).

The writer is driven from another thread, as the engine thread drives it; the reader decodes the chunked
encoding with h11 (uvicorn's own dependency), so a misframed or reordered byte fails the test.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import h11
import pytest
import uvloop

from hybridkv.server.socket_writer import SocketWriter, chunk_frame


class _Sink(asyncio.Protocol):
    pass


@contextmanager
def transport_pair(rcvbuf: int | None = None) -> Iterator[tuple[Any, asyncio.AbstractEventLoop, socket.socket]]:
    """A uvloop transport on one end of a connected TCP pair, its loop running in a thread, and the other end."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.socket()
    if rcvbuf is not None:  # before connecting: the window is agreed at the handshake
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    client.connect(listener.getsockname())
    server_side, _ = listener.accept()
    listener.close()
    if rcvbuf is not None:
        server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, rcvbuf)
    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    made = asyncio.run_coroutine_threadsafe(loop.connect_accepted_socket(_Sink, server_side), loop)
    transport: Any = made.result(timeout=10)[0]
    try:
        yield transport, loop, client
    finally:
        loop.call_soon_threadsafe(transport.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        client.close()


def _in_loop(loop: asyncio.AbstractEventLoop, fn: Any) -> Any:
    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=10)


def _read_chunks(client: socket.socket, expect: int) -> list[bytes]:
    """``expect`` body chunks read from ``client`` (after a head the test writes itself), decoded by h11."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    client.settimeout(10)
    chunks: list[bytes] = []
    part = b""
    while len(chunks) < expect:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = client.recv(1 << 16)
            assert data, f"the connection closed after {len(chunks)} of {expect} chunks"
            conn.receive_data(data)
        elif isinstance(event, h11.Data):  # a chunk may come in pieces: chunk_end marks its last
            part += bytes(event.data)
            if event.chunk_end:
                chunks.append(part)
                part = b""
    return chunks


HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def test_a_chunk_is_framed_as_http_chunked_encoding() -> None:
    assert chunk_frame(b"data: 1\n\n") == b"9\r\ndata: 1\n\n\r\n"
    assert chunk_frame(b"x" * 255) == b"ff\r\n" + b"x" * 255 + b"\r\n"


def test_chunks_written_from_another_thread_arrive_whole_and_in_order() -> None:
    with transport_pair() as (transport, loop, client):
        transport.write(HEAD)  # the head, as uvicorn writes it
        writer = SocketWriter(os.dup(transport.get_extra_info("socket").fileno()), transport, loop)
        bodies = [f"data: {i}\n\n".encode() for i in range(50)]

        sent: list[bool] = []

        def write_all() -> None:  # as the engine thread does
            for body in bodies:
                sent.append(writer.write(body))

        worker = threading.Thread(target=write_all)
        worker.start()
        worker.join(timeout=10)
        assert _read_chunks(client, len(bodies)) == bodies
        assert sent == [True] * len(bodies) and not writer.spilling and not writer.broken
        assert writer.write(b"")  # an empty chunk (the terminator's shape) is never written
        _in_loop(loop, writer.close)


def test_a_slow_reader_gets_every_byte_in_order_through_the_loop_once_the_socket_is_full() -> None:
    with transport_pair(rcvbuf=4096) as (transport, loop, client):
        transport.write(HEAD)
        writer = SocketWriter(os.dup(transport.get_extra_info("socket").fileno()), transport, loop)
        bodies = [f"data: {i} {'x' * 2000}\n\n".encode() for i in range(400)]  # ~800 KB: far above both buffers
        sent = [writer.write(body) for body in bodies]  # nobody reads: the socket fills, the rest is spilled
        first_refused = sent.index(False)  # from the chunk the socket did not take whole: "hand it to the loop"
        assert first_refused > 0 and not any(sent[first_refused:]) and writer.spilling
        got = _read_chunks(client, len(bodies))
        assert got == bodies
        _in_loop(loop, writer.close)


def test_a_gone_peer_breaks_the_writer_without_raising_and_drops_the_rest() -> None:
    with transport_pair() as (transport, loop, client):
        writer = SocketWriter(os.dup(transport.get_extra_info("socket").fileno()), transport, loop)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        client.close()
        for _ in range(20):  # the first write after the reset may still be taken; a later one is refused
            if not writer.write(b"data: 1\n\n"):
                break
            threading.Event().wait(0.01)
        assert writer.broken and not writer.spilling
        assert writer.write(b"dropped") is False  # no exception, nothing sent
        deadline = time.monotonic() + 10
        while not _in_loop(loop, transport.is_closing):  # never silent: the loop aborts the connection
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _in_loop(loop, writer.close)


def test_after_close_a_write_never_reaches_a_descriptor_that_reuses_the_number() -> None:
    with transport_pair() as (transport, loop, _client):
        writer = SocketWriter(os.dup(transport.get_extra_info("socket").fileno()), transport, loop)
        fd = writer._fd
        _in_loop(loop, writer.close)
        read_end, write_end = os.pipe()
        try:
            assert fd in (read_end, write_end)  # the lowest free number: the writer's old one
            writer.write(b"data: late\n\n")
            os.set_blocking(read_end, False)
            with pytest.raises(BlockingIOError):
                os.read(read_end, 100)
        finally:
            os.close(read_end)
            os.close(write_end)


def test_attach_refuses_a_send_that_is_not_uvicorns_chunked_response() -> None:
    async def send(message: Any) -> None:
        pass

    assert SocketWriter.attach(send) is None


class _Cycle:
    """What ``attach`` reads of uvicorn's request cycle: its transport and whether the response is chunked."""

    def __init__(self, transport: Any, chunked: bool = True):
        self.transport = transport
        self.chunked_encoding = chunked

    async def send(self, message: Any) -> None:
        pass


def test_attach_duplicates_the_socket_close_on_exec_and_close_releases_only_the_duplicate() -> None:
    with transport_pair() as (transport, loop, client):
        transport.write(HEAD)
        assert _in_loop(loop, lambda: SocketWriter.attach(_Cycle(transport, chunked=False).send)) is None
        deadline = time.monotonic() + 10  # the head written before attaching
        while transport.get_write_buffer_size() and time.monotonic() < deadline:
            time.sleep(0.01)
        writer = _in_loop(loop, lambda: SocketWriter.attach(_Cycle(transport).send))
        assert writer is not None
        fd, own = writer._fd, transport.get_extra_info("socket").fileno()
        assert fd is not None and fd != own
        assert not os.get_inheritable(fd)  # a process started later never holds a client's connection open
        assert writer.write(b"data: 1\n\n")
        _in_loop(loop, writer.close)
        with pytest.raises(OSError):  # the duplicate is closed ...
            os.fstat(fd)
        transport.write(chunk_frame(b"data: 2\n\n"))  # ... the connection itself is not
        assert _read_chunks(client, 2) == [b"data: 1\n\n", b"data: 2\n\n"]
