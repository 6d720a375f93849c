"""HTTP for llmgw's services and the sim engine: Starlette apps served by uvicorn, in a task group.

`serve(app, host, port)` binds the socket itself, so port 0 works and a bind
that fails raises in the caller of `tg.start(serve, …)`, which gets the bound
port back once uvicorn accepts connections. uvicorn's own signal handling is
off: a service stops its server by cancelling it (its own signal handler
decides when), and the server then closes its listener, lets responses in
flight finish for a moment and cuts streams that would not.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from typing import Any

import anyio
import anyio.abc
import msgspec
import uvicorn
from starlette.responses import Response
from starlette.types import ASGIApp

# Bodies are bounded (`Starlette(max_body_size=MAX_BODY)`, 413 past it) so that one
# bad client cannot exhaust a service's memory.
MAX_BODY = 8 * 1024 * 1024
# After a stop, how long responses in flight (a streamed completion) may run on.
GRACE_S = 1
# How long a stop waits for uvicorn beyond the grace before it gives up on it.
STOP_BOUND_S = GRACE_S + 3.0

_encode = msgspec.json.Encoder().encode


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON (msgspec: Structs encode as they are, and 10,000 nodes in milliseconds), newline-ended."""
    return Response(_encode(value) + b"\n", status, headers, media_type="application/json")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up = anyio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The service's signal handler owns SIGINT and SIGTERM; uvicorn would
        # otherwise take them over while it serves and re-raise them after.
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.up.set()


def bind(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6, as `host` resolves); port 0 picks one.

    `reuse_port`: SO_REUSEPORT, so that several processes of one user each bind the same port
    and the kernel spreads new connections over them (the gateway's workers). `listen` false:
    bound only, which holds the port for such processes without taking any connection."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    # getaddrinfo names IPPROTO_TCP: asyncio turns Nagle's algorithm off on accepted
    # connections only when the listening socket says TCP (with proto 0, every answer
    # waited ~40 ms for the client's delayed ACK).
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        if listen:
            sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.setblocking(False)
    return sock


async def serve(
    app: ASGIApp,
    host: str,
    port: int,
    *,
    protocol: type[asyncio.Protocol] | None = None,
    backlog: int = 2048,
    reuse_port: bool = False,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on host:port until cancelled; `tg.start(serve, …)` returns the bound port.

    `protocol`: uvicorn's HTTP protocol class to use instead of its own (the gateway's counts
    and times its connections); `backlog`: the listen backlog, which is also how many
    connections asyncio accepts in one go; `reuse_port`: as `bind` takes it.
    """
    sock = bind(host, port, reuse_port=reuse_port)
    bound = int(sock.getsockname()[1])
    config = uvicorn.Config(
        app,
        lifespan="off",
        access_log=False,
        log_config=None,
        # uvicorn's start and stop lines would repeat for every server; its errors still show.
        log_level="warning",
        ws="none",
        # Every app here is ASGI 3; uvicorn's guess takes a bound method for ASGI 2.
        interface="asgi3",
        http=protocol or "auto",
        backlog=backlog,
        server_header=False,
        timeout_graceful_shutdown=GRACE_S,
    )
    server = _Server(config)
    stopped = anyio.Event()

    async def run() -> None:
        # Shielded: uvicorn shuts down on `should_exit` (closing its listener and
        # connections); cancelled in the middle, it would leave them open.
        with anyio.CancelScope(shield=True):
            try:
                await server.serve(sockets=[sock])
            finally:
                stopped.set()
                sock.close()
        if not server.up.is_set():
            raise RuntimeError(f"the HTTP server on {host}:{bound} stopped before it started")

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        try:
            # A failed start raises from `run`, which cancels this wait.
            await server.up.wait()
            task_status.started(bound)
            await stopped.wait()
        finally:
            server.should_exit = True
            with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_BOUND_S):
                await stopped.wait()
            server.force_exit = True
