"""Run the app on uvicorn: on a socket bound here (port 0: a free one), in the foreground or a thread.

Foreground (``serve``, the ``hybridkv serve`` command): first warms the backend up (``server.warmup``), then
prints one line ``hybridkv serve: listening on http://HOST:PORT`` once the socket accepts connections (a
parent process may read the port from it),
then serves until SIGTERM or SIGINT. Shutdown: the socket stops accepting, requests in flight get up
to ``shutdown_timeout`` seconds to finish (uvicorn's graceful shutdown); then every request still open
is aborted (a stream ends with an ``abort`` finish and ``[DONE]``, memory released), so the handlers
return on their own; uvicorn's own cancellation, a few seconds later, is only a backstop. Then the
backend is closed (its thread and processes stopped), ``serve`` returns and the process exits 0.

Invariant: the server binds only the host it is given (127.0.0.1 unless told otherwise).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import threading
import time
from types import FrameType

import uvicorn

from hybridkv.server.app import create_app
from hybridkv.server.backend import Backend
from hybridkv.server.connections import guarded_protocol
from hybridkv.server.state import ServerConfig, ServerState
from hybridkv.server.warmup import WarmupFailed, warm_up
from hybridkv.units import format_bytes

BACKSTOP_S = 5  # uvicorn cancels what is still running this long after the requests were aborted
SWITCH_INTERVAL_S = 0.0005
"""The foreground server's GIL switch interval (Python's default: 5 ms). The engine thread and the
event loop take turns on the GIL; at 5 ms a streamed token or a new request can wait a whole
interval. Measured (bench serve, 16 requests alone, alternating runs): overhead p50 10.6 / 11.6 ms
at 0.5 ms vs 15.3 / 15.4 ms at 5 ms."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``OSError`` naming both when it cannot be had)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so, and without it every
    # response (headers, then body: two writes) waits for the client's delayed ACK, ~40 ms
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.state.connect_loop()
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(self.shutdown_timeout, self.state.abort_all, "the server is shutting down")
        try:
            await super().shutdown(sockets)
        finally:
            self.state.close_loop()


class HttpServer:
    def __init__(self, backend: Backend, config: ServerConfig, sock: socket.socket, shutdown_timeout: float):
        """``sock``: a listening socket from ``bind`` (bound before a slow backend starts, so a taken port
        fails at once); the server closes it."""
        self.backend = backend
        self.shutdown_timeout = shutdown_timeout
        self.sock = sock
        self.host, self.port = str(sock.getsockname()[0]), int(sock.getsockname()[1])
        self.state = ServerState(backend, config)
        uv = uvicorn.Config(
            create_app(self.state),
            http=guarded_protocol(config.connection_limits, self.state.connections),  # before any request
            lifespan="off",
            proxy_headers=False,  # nothing here reads the client's address: one wrapper less per request
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(shutdown_timeout) + BACKSTOP_S,
        )
        self.uvicorn = _Uvicorn(uv, self.state, shutdown_timeout)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve until ``should_exit`` (a signal in the main thread, or ``stop``); then close the backend."""
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self.sock.close()
            self.backend.close(self.shutdown_timeout)

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve from a background thread (tests, benchmarks); returns once it accepts connections."""
        self._thread = threading.Thread(target=self.run, name="hybridkv-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start within {timeout_s} s")
            time.sleep(0.01)

    def stop(self) -> None:
        """Graceful shutdown of a ``start``ed server (bounded by the shutdown timeout)."""
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(self.shutdown_timeout + 30)


def serve(
    backend: Backend, config: ServerConfig, sock: socket.socket, shutdown_timeout: float, warmup: bool = True
) -> int:
    """Serve on ``sock`` (from ``bind``) in the foreground until SIGTERM / SIGINT; 0 after a clean shutdown.
    ``warmup``: run ``warm_up`` first (the socket queues connections meanwhile; ``/health`` answers after it)."""
    server = HttpServer(backend, config, sock, shutdown_timeout)
    got: list[int] = []

    def remember(sig: int, frame: FrameType | None) -> None:
        got.append(sig)  # uvicorn re-raises the signal it handled once it stopped: do not die here
        server.uvicorn.should_exit = True  # a signal before uvicorn took over: it stops at once

    # uvicorn installs its own handlers while it runs and restores (then re-raises to) these
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, remember)
    warmed = ""
    if warmup:
        try:
            report = warm_up(backend, stop=lambda: bool(got))
        except WarmupFailed as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sock.close()
            backend.close(shutdown_timeout)
            return 1
        warmed = f"; warmed up with {report.requests} requests in {report.seconds:.2f} s"
        warmed += f", {format_bytes(report.reserved_bytes)} of step buffers reserved" if report.reserved_bytes else ""
        warmed += " (ended early)" if report.timed_out else ""
    print(f"hybridkv serve: listening on {server.url} (model {backend.info.name}{warmed})", flush=True)
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the whole process is this server
    server.run()
    names = ", ".join(signal.Signals(s).name for s in dict.fromkeys(got)) or "no signal"
    print(f"hybridkv serve: shut down ({names})", file=sys.stderr, flush=True)
    return 0
