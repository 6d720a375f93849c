"""Serving an ASGI app with uvicorn inside the service's task group.

The socket is bound here, before uvicorn starts, so port 0 works and a port
in use fails in the caller's `tg.start()`. uvicorn's own signal handling is
turned off: the service owns SIGTERM and Ctrl-C, and stopping means telling
uvicorn to exit, then giving open requests a bounded grace.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Generator

import anyio
import anyio.abc
import uvicorn
from starlette.types import ASGIApp

from llmgw_core.errors import ConfigError


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The service's signal receiver decides when to stop, not uvicorn.
        yield


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY on accepted connections only
    # when the listening socket's proto says TCP. Without it every response waited ~40 ms
    # for the client's delayed ACK (Nagle's algorithm holding the body behind the headers).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
            "choose another http: port (0 takes a free one) or stop what holds it"
        ) from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve_app(
    app: ASGIApp,
    host: str,
    port: int,
    *,
    grace_s: int = 5,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on host:port until cancelled; `task_status.started(port)` once bound."""
    sock = bind(host, port)
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=grace_s
    )
    server = _Server(config)
    done = anyio.Event()

    async def run() -> None:
        # Shielded: a cancelled service stops uvicorn by `should_exit`, so open
        # requests get their grace instead of being cut mid-answer.
        with anyio.CancelScope(shield=True):
            try:
                await server.serve(sockets=[sock])
            finally:
                done.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            task_status.started(sock.getsockname()[1])
            try:
                await done.wait()
                # uvicorn stopped on its own (its startup failed): the service must not go on
                # as if it were serving.
                raise RuntimeError(f"the HTTP server on {host}:{port} stopped; see the log above")
            finally:
                server.should_exit = True
                with anyio.CancelScope(shield=True), anyio.move_on_after(grace_s + 1):
                    await done.wait()
                server.force_exit = True
    finally:
        sock.close()
